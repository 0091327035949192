/*
 * indexer._native: C versions of the hot loops on kvrouter's request path.
 *
 *   ids_from_json(raw)                     -> bytes      (a /tokenize "tokens" array as uint32 LE)
 *   chain_keys(seed, data, unit, limit)    -> list[int]  (indexer.keys.chain_keys over bytes)
 *   run_scan(tables, keys, first, step, count, alive)
 *                                          -> (b, now)   (full_attention_run's block loop,
 *                                                         indexer/_scan.c)
 *   ids_to_json(data)                      -> bytes      (uint32 LE ids as a compact JSON array)
 *   decode_batch: the event plane's decoder (indexer/_ingest.c)
 *   store_dense, store_run, remove_hashes: residency in C (indexer/_residency.c)
 *   U64Map: the index's maps (indexer/_u64map.c, _u64map_type.c)
 *
 * indexer/native.py is the public face and holds the pure-Python equivalents; the tests check
 * both against each other. Every input is read through bounds-checked indexes only: any bytes
 * are safe, and the only allocation is the result (run_scan looks uint64 keys up without an
 * object; only a key or value outside uint64 makes one, freed at once).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#if defined(__SSE2__) && !defined(KVROUTER_NO_SSE2)
#include <emmintrin.h>
#endif

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_ingest.h"
#include "_scan.h"
#include "_u64map.h"

/* ------------------------------------------------------------------ ids_from_json */

#define ONES 0x0101010101010101ull

static inline int
is_digit(unsigned char c)
{
    return c >= '0' && c <= '9';
}

static inline int
is_ws(unsigned char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

static inline Py_ssize_t
skip_ws(const unsigned char *s, Py_ssize_t i, Py_ssize_t n)
{
    while (i < n && is_ws(s[i])) {
        i++;
    }
    return i;
}

static inline uint64_t
load8(const unsigned char *p) /* 8 bytes, p[0] in the low byte, on any host */
{
    /* Written out (not a loop) so that GCC and Clang make it one load on little-endian hosts. */
    return (uint64_t)p[0] | ((uint64_t)p[1] << 8) | ((uint64_t)p[2] << 16) |
           ((uint64_t)p[3] << 24) | ((uint64_t)p[4] << 32) | ((uint64_t)p[5] << 40) |
           ((uint64_t)p[6] << 48) | ((uint64_t)p[7] << 56);
}

static inline void
store_le32(unsigned char *w, uint32_t v)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    memcpy(w, &v, 4);
#else
    w[0] = (unsigned char)(v & 0xFF);
    w[1] = (unsigned char)((v >> 8) & 0xFF);
    w[2] = (unsigned char)((v >> 16) & 0xFF);
    w[3] = (unsigned char)((v >> 24) & 0xFF);
#endif
}

/* Bits k of p[0:64]: returns those with p[k] == ',' and sets *other to those with p[k] neither
 * a comma nor a digit (SSE2 where there is SSE2, else 8 bytes at a time). */
static inline uint64_t
comma_mask64(const unsigned char *p, uint64_t *other)
{
#if defined(__SSE2__) && !defined(KVROUTER_NO_SSE2)
    const __m128i comma = _mm_set1_epi8(','), zero = _mm_set1_epi8('0'), nine = _mm_set1_epi8(9);
    uint64_t commas = 0, plain = 0;
    for (int k = 0; k < 4; k++) {
        __m128i v = _mm_loadu_si128((const __m128i *)(const void *)(p + 16 * k));
        __m128i c = _mm_cmpeq_epi8(v, comma);
        __m128i d = _mm_sub_epi8(v, zero); /* a digit iff 0..9 as an unsigned byte */
        d = _mm_cmpeq_epi8(_mm_min_epu8(d, nine), d);
        commas |= (uint64_t)(uint32_t)_mm_movemask_epi8(c) << (16 * k);
        plain |= (uint64_t)(uint32_t)_mm_movemask_epi8(_mm_or_si128(c, d)) << (16 * k);
    }
    *other = ~plain;
    return commas;
#else
    const uint64_t low7 = 0x7F7F7F7F7F7F7F7Full;
    uint64_t m = 0;
    for (int k = 0; k < 8; k++) {
        uint64_t y = load8(p + 8 * k) ^ (ONES * ',');
        uint64_t zero = ~(((y & low7) + low7) | y | low7); /* 0x80 in exactly the zero bytes */
        /* Gather the 8 flag bits (one per byte) into the top byte, byte j to bit 56 + j. */
        m |= ((((zero >> 7) * 0x0102040810204080ull) >> 56) & 0xFF) << (8 * k);
    }
    *other = ~(uint64_t)0; /* unknown: the caller checks each id's digits itself */
    return m;
#endif
}

static inline int
popcount64(uint64_t x) /* portable: no -mpopcnt needed, no libgcc call */
{
    x = x - ((x >> 1) & 0x5555555555555555ull);
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0Full;
    return (int)((x * ONES) >> 56);
}

/* Number of commas in p[0:n]. */
static Py_ssize_t
count_commas(const unsigned char *p, Py_ssize_t n)
{
    Py_ssize_t count = 0, i = 0;
    for (; n - i >= 64; i += 64) {
        uint64_t other;
        count += popcount64(comma_mask64(p + i, &other));
    }
    for (; i < n; i++) {
        count += p[i] == ',';
    }
    return count;
}

/* Index of the lowest set bit of x != 0. */
static inline unsigned
ctz64(uint64_t x)
{
#if defined(__GNUC__) || defined(__clang__)
    return (unsigned)__builtin_ctzll(x);
#else
    unsigned k = 0;
    while ((x & 1) == 0) {
        x >>= 1;
        k++;
    }
    return k;
#endif
}

/* How many of the 8 bytes of x (first byte low) are ASCII digits before the first non-digit. */
static inline unsigned
digit_run8(uint64_t x)
{
    const uint64_t hi = 0xF0F0F0F0F0F0F0F0ull, threes = ONES * 0x30;
    /* A byte is a digit iff its high nibble is 3 and stays 3 after adding 6. Only a byte
     * >= 0xFA carries into the next one, and that byte is already a non-digit. */
    uint64_t bad = ((x & hi) ^ threes) | (((x + ONES * 6) & hi) ^ threes);
    return bad == 0 ? 8 : ctz64(bad) >> 3;
}

/* The value of the first len (1..8) bytes of x, all ASCII digits (Lemire's SWAR method). */
static inline uint32_t
digits8_value(uint64_t x, unsigned len)
{
    uint64_t t = (x ^ (ONES * 0x30)) << (8 * (8 - len)); /* digit values, leading zeros first */
    t = t * 10 + (t >> 8);
    t = (((t & 0x000000FF000000FFull) * (100 + (1000000ull << 32))) +
         (((t >> 16) & 0x000000FF000000FFull) * (1 + (10000ull << 32)))) >>
        32;
    return (uint32_t)t;
}

static PyObject *
bad_json(const char *what, Py_ssize_t at)
{
    PyErr_Format(PyExc_ValueError, "token ids JSON: %s (byte %zd)", what, at);
    return NULL;
}

/* Why a token id is not acceptable at s[i] (which is not a digit, or is past the end). */
static PyObject *
bad_value(const unsigned char *s, Py_ssize_t i, Py_ssize_t n)
{
    if (i >= n) {
        return bad_json("truncated, expected a token id", i);
    }
    switch (s[i]) {
    case '-':
        return bad_json("negative token id", i);
    case ']':
        return bad_json("trailing comma in array", i);
    case ',':
        return bad_json("expected a token id, got ','", i);
    case '"':
        return bad_json("expected a token id, got a string", i);
    case '[':
    case '{':
        return bad_json("expected a token id, got a nested array or object", i);
    default:
        return bad_json("expected a token id", i);
    }
}

static PyObject *
ids_from_json(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const unsigned char *s = (const unsigned char *)view.buf;
    const Py_ssize_t n = view.len;
    PyObject *out = NULL;
    Py_ssize_t i = skip_ws(s, 0, n);

    if (i >= n) {
        bad_json("empty input, expected '['", i);
        goto done;
    }
    if (s[i] != '[') {
        bad_json("expected '[' (a JSON array of token ids)", i);
        goto done;
    }
    i = skip_ws(s, i + 1, n);
    if (i < n && s[i] == ']') {
        i = skip_ws(s, i + 1, n);
        if (i < n) {
            bad_json("trailing characters after ']'", i);
            goto done;
        }
        out = PyBytes_FromStringAndSize(NULL, 0);
        goto done;
    }

    /* Upper bound on the number of ids: one more than the commas after '['. A valid array has
     * exactly that many; anything else fails below, so the bound is never exceeded. */
    Py_ssize_t bound = 1 + count_commas(s + i, n - i);
    if (bound > PY_SSIZE_T_MAX / 4) { /* unreachable for real inputs; keeps 4 * bound sane */
        PyErr_NoMemory();
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, bound * 4);
    if (out == NULL) {
        goto done;
    }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    Py_ssize_t count = 0;

    /* Fast path, for the compact arrays vLLM sends ("[1,22,333]"; one space after each comma
     * is fine too): each id's span comes from a bitmap of the commas, so finding the next id
     * does not wait on parsing this one. It takes only spans that are 1 to 8 plain digits
     * followed by a comma, within whole 64-byte blocks, and leaves everything from the first
     * other span on (the last id, whitespace, long, bad or leading-zero ids) to the careful
     * loop below, which then decides exactly as if it had parsed the whole input itself. */
    Py_ssize_t a = i; /* first byte of the current id's span */
    for (Py_ssize_t blk = i; n - blk >= 64; blk += 64) {
        uint64_t other;
        uint64_t m = comma_mask64(s + blk, &other);
        for (; m != 0; m &= m - 1) {
            const Py_ssize_t c = blk + (Py_ssize_t)ctz64(m); /* the comma ending this span */
            Py_ssize_t start = a;
            if (s[start] == ' ') {
                start++;
            }
            const Py_ssize_t len = c - start;
            if (len < 1 || len > 8 || n - start < 8 || count >= bound) {
                goto careful;
            }
            const uint64_t x = load8(s + start);
            /* A span inside a block of only digits and commas needs no digit check; one
             * that began in the previous block does. */
            const int checked = other == 0 && start >= blk;
            if ((!checked && (Py_ssize_t)digit_run8(x) != len) || (s[start] == '0' && len > 1)) {
                goto careful;
            }
            const uint32_t v = digits8_value(x, (unsigned)len);
            store_le32(w, v);
            w += 4;
            count++;
            a = c + 1;
        }
    }
careful:
    i = skip_ws(s, a, n);
    for (;;) {
        /* s[i] is the first byte of a value (or i == n). */
        if (i >= n || !is_digit(s[i])) {
            bad_value(s, i, n);
            goto fail;
        }
        const Py_ssize_t start = i;
        uint64_t v;
        if (n - i >= 8) { /* fast path: up to 8 digits at once */
            const uint64_t x = load8(s + i);
            const unsigned len = digit_run8(x); /* >= 1: s[i] is a digit */
            v = digits8_value(x, len);
            i += len;
        }
        else {
            v = (uint64_t)(s[i] - '0');
            i++;
        }
        /* Digits beyond the fast path's 8 (or all but the first near the end): one by one. */
        while (i < n && is_digit(s[i])) {
            v = v * 10 + (uint64_t)(s[i] - '0'); /* v < 2**32 before: no uint64 wrap */
            if (v > 0xFFFFFFFFu) {
                bad_json("token id out of range [0, 4294967295]", start);
                goto fail;
            }
            i++;
        }
        if (s[start] == '0' && i - start > 1) {
            bad_json("leading zero in token id", start);
            goto fail;
        }
        if (i < n && (s[i] == '.' || s[i] == 'e' || s[i] == 'E')) {
            bad_json("token id is not an integer", start);
            goto fail;
        }
        if (count >= bound) { /* cannot happen (bound counts separators); belt and braces */
            bad_json("internal error: more ids than separators", start);
            goto fail;
        }
        store_le32(w, (uint32_t)v);
        w += 4;
        count++;

        if (i < n && s[i] == ',') { /* compact JSON: the common case */
            i++;
            if (i < n && is_digit(s[i])) {
                continue;
            }
            i = skip_ws(s, i, n);
            continue;
        }
        i = skip_ws(s, i, n);
        if (i >= n) {
            bad_json("truncated, expected ',' or ']'", i);
            goto fail;
        }
        if (s[i] == ',') {
            i = skip_ws(s, i + 1, n);
            continue;
        }
        if (s[i] == ']') {
            i = skip_ws(s, i + 1, n);
            if (i < n) {
                bad_json("trailing characters after ']'", i);
                goto fail;
            }
            break;
        }
        bad_json("expected ',' or ']'", i);
        goto fail;
    }
    if (count != bound && _PyBytes_Resize(&out, count * 4) < 0) {
        goto done; /* _PyBytes_Resize has cleared out and set the error */
    }
    goto done;

fail:
    Py_CLEAR(out);
done:
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------ chain_keys */

/* obj as a long long via __index__; *overflow is -1/+1 (and the result meaningless) when it
 * does not fit. Returns -1 with an exception set (TypeError) for a non-integer. */
static long long
as_long_long(PyObject *obj, int *overflow)
{
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        return -1;
    }
    long long v = PyLong_AsLongLongAndOverflow(idx, overflow);
    Py_DECREF(idx);
    return v;
}

static PyObject *
chain_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "chain_keys() takes exactly 4 arguments (seed, data, unit, limit), %zd given",
                     nargs);
        return NULL;
    }
    PyObject *seed_obj = args[0], *data_obj = args[1], *unit_obj = args[2], *limit_obj = args[3];
    /* unit and limit: any int, however large, as in Python (a huge unit gives no keys). */
    int unit_overflow = 0;
    long long unit = as_long_long(unit_obj, &unit_overflow);
    if (unit == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (unit_overflow < 0 || (unit_overflow == 0 && unit <= 0)) {
        PyErr_SetString(PyExc_ValueError, "chain_keys: unit must be positive");
        return NULL;
    }
    int limit_overflow = 1; /* None: no cap, as for a limit beyond long long */
    long long limit = 0;
    if (limit_obj != Py_None) {
        limit = as_long_long(limit_obj, &limit_overflow);
        if (limit == -1 && PyErr_Occurred()) {
            return NULL;
        }
        if (limit_overflow < 0 || (limit_overflow == 0 && limit < 0)) {
            PyErr_SetString(PyExc_ValueError, "chain_keys: limit must not be negative");
            return NULL;
        }
    }
    /* Same conversion as python-xxhash's seed argument (any int-like, reduced modulo 2**64),
     * so the C and Python paths agree even on seeds outside [0, 2**64). */
    uint64_t key = (uint64_t)PyLong_AsUnsignedLongLongMask(seed_obj);
    if (key == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }

    Py_buffer view;
    if (PyObject_GetBuffer(data_obj, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* Whole units in data; a unit of more than len/4 tokens (however large) fits none. */
    Py_ssize_t nkeys = 0;
    size_t ustep = 0;
    if (unit_overflow == 0 && (unsigned long long)unit <= (size_t)view.len / 4u) {
        ustep = (size_t)unit * 4u; /* <= view.len: no overflow */
        nkeys = (Py_ssize_t)((size_t)view.len / ustep);
    }
    if (limit_overflow == 0 && limit < nkeys) {
        nkeys = (Py_ssize_t)limit;
    }
    PyObject *out = PyList_New(nkeys);
    if (out == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    for (Py_ssize_t k = 0; k < nkeys; k++, p += ustep) {
        key = XXH3_64bits_withSeed(p, ustep, (XXH64_hash_t)key);
        PyObject *item = PyLong_FromUnsignedLongLong((unsigned long long)key);
        if (item == NULL) {
            Py_DECREF(out); /* items not yet set are NULL; list dealloc skips them */
            PyBuffer_Release(&view);
            return NULL;
        }
        PyList_SET_ITEM(out, k, item);
    }
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------ ids_to_json */

static inline unsigned
decimal_digits(uint32_t v)
{
    return v < 10 ? 1
         : v < 100 ? 2
         : v < 1000 ? 3
         : v < 10000 ? 4
         : v < 100000 ? 5
         : v < 1000000 ? 6
         : v < 10000000 ? 7
         : v < 100000000 ? 8
         : v < 1000000000 ? 9
         : 10;
}

static const char DIGIT_PAIRS[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

/* Writes v's d decimal digits ending at w[d-1], two at a time (half the dependent divisions). */
static inline void
write_decimal(char *w, uint32_t v, unsigned d)
{
    char *p = w + d;
    while (v >= 100) {
        unsigned r = (v % 100) * 2;
        v /= 100;
        *--p = DIGIT_PAIRS[r + 1];
        *--p = DIGIT_PAIRS[r];
    }
    if (v >= 10) {
        *--p = DIGIT_PAIRS[v * 2 + 1];
        *--p = DIGIT_PAIRS[v * 2];
    }
    else {
        *--p = (char)('0' + v);
    }
}

/* The inverse of ids_from_json: packed little-endian uint32 ids as "[1,2,3]" (no spaces). The
 * result is allocated at its largest possible size (11 bytes an id) and shrunk once at the end:
 * one pass over the ids, and no allocation but the result. */
static PyObject *
ids_to_json(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    PyObject *out = NULL;
    if (view.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError, "ids_to_json: %zd bytes is not a whole number of uint32",
                     view.len);
        goto done;
    }
    const unsigned char *p = (const unsigned char *)view.buf;
    Py_ssize_t n = view.len / 4;
    if (n > (PY_SSIZE_T_MAX - 2) / 11) {
        PyErr_NoMemory();
        goto done;
    }
    out = PyBytes_FromStringAndSize(NULL, 2 + 11 * n);
    if (out == NULL) {
        goto done;
    }
    char *start = PyBytes_AS_STRING(out);
    char *w = start;
    *w++ = '[';
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)p[4 * i] | (uint32_t)p[4 * i + 1] << 8 |
                     (uint32_t)p[4 * i + 2] << 16 | (uint32_t)p[4 * i + 3] << 24;
        unsigned d = decimal_digits(v);
        write_decimal(w, v, d);
        w += d;
        *w++ = ',';
    }
    if (n > 0) {
        w--; /* the last comma */
    }
    *w++ = ']';
    if (_PyBytes_Resize(&out, w - start) < 0) {
        out = NULL; /* _PyBytes_Resize freed it and set the error */
    }
done:
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef native_methods[] = {
    {"ids_from_json", (PyCFunction)ids_from_json, METH_O,
     "ids_from_json(raw, /)\n--\n\n"
     "The JSON array of token ids in raw (any bytes-like) as little-endian uint32 bytes.\n"
     "Raises ValueError unless raw is an array of integers in [0, 2**32)."},
    {"chain_keys", (PyCFunction)(void (*)(void))chain_keys, METH_FASTCALL,
     "chain_keys(seed, data, unit, limit, /)\n--\n\n"
     "indexer.keys.chain_keys over the bytes-like data: xxh3_64 of each whole unit of\n"
     "unit*4 bytes, seeded by the previous key, at most limit keys (None: no cap)."},
    {"run_scan", (PyCFunction)(void (*)(void))native_run_scan, METH_FASTCALL,
     "run_scan(tables, keys, first, step, count, alive, /)\n--\n\n"
     "For blocks b = first .. count-1 (key keys[(b+1)*step-1]): now = alive &\n"
     "tables.get(key, 0); the first (b, now) with now != alive, else\n"
     "(count, alive). See indexer.native.run_scan."},
    {"ids_to_json", (PyCFunction)ids_to_json, METH_O,
     "ids_to_json(data, /)\n--\n\n"
     "Little-endian uint32 ids (any bytes-like, a multiple of 4 bytes) as a compact JSON\n"
     "array, the inverse of ids_from_json."},
    {"decode_batch", (PyCFunction)ingest_decode_batch, METH_O,
     "decode_batch(payload, /)\n--\n\n"
     "A vLLM msgpack EventBatch of the common shape as (ts, dp_rank, records, events), hashes\n"
     "and token ids as packed bytes, a run of one-hash removals one record; None for any\n"
     "other payload. See indexer/_ingest.c."},
    {"store_dense", (PyCFunction)(void (*)(void))ingest_store_dense, METH_FASTCALL,
     "store_dense(res, hmap, bit, seed, parent, hashes, tokens, unit, block_size, decided, /)\n"
     "--\n\nRecord a dense full-attention BlockStored; see indexer/_ingest.c."},
    {"store_run", (PyCFunction)(void (*)(void))ingest_store_run, METH_FASTCALL,
     "store_run(res, hmap, bit, records, start, model_seed, unit, block_size, group, kind, "
     "window, resident, decided, /)\n--\n\nstore_dense over a batch's plain stores."},
    {"remove_hashes", (PyCFunction)(void (*)(void))ingest_remove_hashes, METH_FASTCALL,
     "remove_hashes(res, hmap, bit, hashes, dups, extra_refs, dup_prefix, sink, /)\n--\n\n"
     "Residency.remove over packed uint64 hashes; see indexer/_ingest.c."},
    {NULL, NULL, 0, NULL},
};

int match_add_functions(PyObject *module); /* indexer/_match.c */

static PyModuleDef_Slot native_slots[] = {
    {Py_mod_exec, (void *)u64map_add_type},
    {Py_mod_exec, (void *)match_add_functions},
    {0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "indexer._native",
    .m_doc = "C versions of kvrouter's request-path loops; use indexer.native, not this module.",
    .m_size = 0,
    .m_methods = native_methods,
    .m_slots = native_slots,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    return PyModuleDef_Init(&native_module);
}
