/*
 * The event plane's hot path in C, part of indexer._native (indexer/ingest.py decides when it
 * applies; the Python code it mirrors is the reference):
 *
 *   decode_batch(payload)       -> (ts, dp_rank, records) | None
 *       vLLM's msgpack EventBatch in its common shape (map-encoded events, known keys only,
 *       int hashes) into one tuple per event, hashes and token ids left as packed bytes:
 *       no Python object per block. None for anything else; the Python decoder then decides.
 *   store_dense(res, hmap, bit, seed, parent, hashes, tokens, unit, block_size, decided)
 *       -> blocks added | BAIL | REANNOUNCED
 *       A dense full-attention BlockStored: chain its content keys and record it
 *       (Residency.add_many), or BAIL before changing anything when a rarer rule applies.
 *   remove_hashes(res, hmap, bit, hashes, dups, extra_refs, dup_prefix, sink)
 *       -> (removed, unknown, cleared)   (Residency.remove over packed hashes)
 *
 * Bound: input is read through bounds-checked cursors only; an array header may not announce
 * more elements than bytes remain, so a lying header allocates nothing large.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_ingest.h"
#include "_u64map.h"

#define SLOTS 1024 /* indexer.staggered.SLOTS */
#define STORE_BAIL (-1)
#define STORE_REANNOUNCED (-2)

/* ------------------------------------------------------------------ msgpack cursor */

enum { T_NIL, T_BOOL, T_UINT, T_NEG, T_FLOAT, T_STR, T_BIN, T_ARR, T_MAP, T_EXT };

typedef struct {
    const unsigned char *p, *end;
} cursor;

typedef struct {
    int t;
    uint64_t u;  /* T_UINT value, T_NEG value as int64 bits */
    double f;    /* T_FLOAT */
    const char *s; /* T_STR / T_BIN bytes */
    size_t n;    /* T_STR / T_BIN length, T_ARR / T_MAP count */
} item;

static inline int
take(cursor *c, size_t n, const unsigned char **out)
{
    if ((size_t)(c->end - c->p) < n) {
        return -1;
    }
    *out = c->p;
    c->p += n;
    return 0;
}

static inline uint64_t
be(const unsigned char *b, int n)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | b[i];
    }
    return v;
}

/* The next item's header (a str's or bin's bytes are consumed too). -1: truncated or 0xc1. */
static int
next_item(cursor *c, item *it)
{
    const unsigned char *b;
    if (take(c, 1, &b) < 0) {
        return -1;
    }
    unsigned tag = b[0];
    int len = 0;
    if (tag <= 0x7f) {
        it->t = T_UINT, it->u = tag;
        return 0;
    }
    if (tag >= 0xe0) {
        it->t = T_NEG, it->u = (uint64_t)(int64_t)(int8_t)tag;
        return 0;
    }
    if ((tag & 0xf0) == 0x80 || (tag & 0xf0) == 0x90) {
        it->t = (tag & 0xf0) == 0x80 ? T_MAP : T_ARR, it->n = tag & 0x0f;
        return 0;
    }
    if ((tag & 0xe0) == 0xa0) {
        it->t = T_STR, it->n = tag & 0x1f;
        goto payload;
    }
    switch (tag) {
    case 0xc0: it->t = T_NIL; return 0;
    case 0xc2: case 0xc3: it->t = T_BOOL, it->u = tag == 0xc3; return 0;
    case 0xcc: case 0xcd: case 0xce: case 0xcf:
        len = 1 << (tag - 0xcc);
        if (take(c, (size_t)len, &b) < 0) return -1;
        it->t = T_UINT, it->u = be(b, len);
        return 0;
    case 0xd0: case 0xd1: case 0xd2: case 0xd3: {
        len = 1 << (tag - 0xd0);
        if (take(c, (size_t)len, &b) < 0) return -1;
        uint64_t raw = be(b, len);
        int shift = 64 - 8 * len;
        int64_t v = shift ? (int64_t)(raw << shift) >> shift : (int64_t)raw;
        it->t = v < 0 ? T_NEG : T_UINT, it->u = (uint64_t)v;
        return 0;
    }
    case 0xca: case 0xcb: {
        len = tag == 0xca ? 4 : 8;
        if (take(c, (size_t)len, &b) < 0) return -1;
        uint64_t raw = be(b, len);
        if (len == 4) {
            uint32_t r32 = (uint32_t)raw;
            float f;
            memcpy(&f, &r32, 4);
            it->f = f;
        } else {
            memcpy(&it->f, &raw, 8);
        }
        it->t = T_FLOAT;
        return 0;
    }
    case 0xd9: case 0xda: case 0xdb:
        len = 1 << (tag - 0xd9);
        if (take(c, (size_t)len, &b) < 0) return -1;
        it->t = T_STR, it->n = (size_t)be(b, len);
        goto payload;
    case 0xc4: case 0xc5: case 0xc6:
        len = 1 << (tag - 0xc4);
        if (take(c, (size_t)len, &b) < 0) return -1;
        it->t = T_BIN, it->n = (size_t)be(b, len);
        goto payload;
    case 0xdc: case 0xdd: case 0xde: case 0xdf:
        len = (tag & 1) ? 4 : 2;
        if (take(c, (size_t)len, &b) < 0) return -1;
        it->t = tag <= 0xdd ? T_ARR : T_MAP, it->n = (size_t)be(b, len);
        return 0;
    default: /* ext types, 0xc1: never in a vLLM batch */
        it->t = T_EXT;
        return 0;
    }
payload:
    if (take(c, it->n, &b) < 0) {
        return -1;
    }
    it->s = (const char *)b;
    return 0;
}

/* An array header whose count fits the remaining bytes (one byte per element at least). */
static int
next_array(cursor *c, size_t *n)
{
    item it;
    if (next_item(c, &it) < 0 || it.t != T_ARR || it.n > (size_t)(c->end - c->p)) {
        return -1;
    }
    *n = it.n;
    return 0;
}

static inline void
store_le(unsigned char *w, uint64_t v, int width)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    if (width == 8) {
        memcpy(w, &v, 8);
    } else {
        uint32_t v32 = (uint32_t)v;
        memcpy(w, &v32, 4);
    }
#else
    for (int k = 0; k < width; k++) {
        w[k] = (unsigned char)(v >> (8 * k));
    }
#endif
}

/* ------------------------------------------------------------------ event fields */

enum {
    F_TYPE, F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID, F_MEDIUM, F_LORA_NAME,
    F_EXTRA, F_GROUP, F_KIND, F_WINDOW, F_LOCALITY, F_OWNERSHIP, F_SESSION, F_LOOKAHEAD, F_COUNT
};

static const char *const FIELD_NAMES[F_COUNT] = {
    "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
    "lookahead_token_ids",
};

enum { KIND_STORED, KIND_REMOVED, KIND_CLEARED };

#define BIT(f) (1u << (f))
static const unsigned ALLOWED[3] = {
    BIT(F_COUNT) - 1,
    BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_MEDIUM) | BIT(F_GROUP) | BIT(F_LOCALITY) |
        BIT(F_OWNERSHIP),
    BIT(F_TYPE),
};
static const unsigned REQUIRED[3] = {
    BIT(F_TYPE) | BIT(F_HASHES) | BIT(F_PARENT) | BIT(F_TOKENS) | BIT(F_BLOCK_SIZE),
    BIT(F_TYPE) | BIT(F_HASHES),
    BIT(F_TYPE),
};

static int
field_of(const item *key)
{
    if (key->t != T_STR) {
        return -1;
    }
    for (int f = 0; f < F_COUNT; f++) {
        if (strlen(FIELD_NAMES[f]) == key->n && memcmp(FIELD_NAMES[f], key->s, key->n) == 0) {
            return f;
        }
    }
    return -1;
}

/* Strings every batch repeats, made once: a str per event field would be most of a removal's
 * cost. Returns a new reference, or NULL with an error set (invalid UTF-8 included). */
static PyObject *
str_value(const item *it)
{
    static const char *const COMMON[] = {"BlockStored", "BlockRemoved", "AllBlocksCleared",
                                         "GPU", "CPU", "full_attention", "sliding_window"};
    static PyObject *cache[sizeof COMMON / sizeof COMMON[0]];
    for (size_t i = 0; i < sizeof COMMON / sizeof COMMON[0]; i++) {
        if (strlen(COMMON[i]) == it->n && memcmp(COMMON[i], it->s, it->n) == 0) {
            if (cache[i] == NULL && (cache[i] = PyUnicode_InternFromString(COMMON[i])) == NULL) {
                return NULL;
            }
            return Py_NewRef(cache[i]);
        }
    }
    return PyUnicode_DecodeUTF8(it->s, (Py_ssize_t)it->n, NULL);
}

/* Packed little-endian values of an array of non-negative ints below `limit` (0: 2**64),
 * `width` bytes each. NULL without an error: not that shape. */
static PyObject *
packed_ints(cursor *c, int width, uint64_t limit)
{
    size_t n;
    if (next_array(c, &n) < 0) {
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * (size_t)width));
    if (out == NULL) {
        return NULL;
    }
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    for (size_t i = 0; i < n; i++, w += width) {
        uint64_t v;
        const unsigned char *p = c->p;
        /* The unsigned encodings inline (every token id and hash vLLM sends); the rest, such
         * as a non-negative value in a signed encoding, through next_item. */
        if (p < c->end && *p <= 0x7f) {
            v = *p, c->p = p + 1;
        } else if (p < c->end && *p >= 0xcc && *p <= 0xcf &&
                   (size_t)(c->end - p) > (size_t)(1u << (*p - 0xcc))) {
            int len = 1 << (*p - 0xcc);
            v = be(p + 1, len), c->p = p + 1 + len;
        } else {
            item it;
            if (next_item(c, &it) < 0 || it.t != T_UINT) {
                goto bail;
            }
            v = it.u;
        }
        if (limit && v >= limit) {
            goto bail;
        }
        if (width == 8) {
            store_le(w, v, 8);
        } else {
            store_le(w, v, 4);
        }
    }
    return out;
bail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *
int_object(const item *it)
{
    return it->t == T_UINT ? PyLong_FromUnsignedLongLong(it->u)
                           : PyLong_FromLongLong((long long)(int64_t)it->u);
}

/* One field's value as the Python object the record holds. NULL without an error: bail. */
static PyObject *
field_value(cursor *c, int f)
{
    if (f == F_HASHES) {
        return packed_ints(c, 8, 0);
    }
    if (f == F_TOKENS) {
        return packed_ints(c, 4, (uint64_t)1 << 32);
    }
    item it;
    if (next_item(c, &it) < 0) {
        return NULL;
    }
    switch (f) {
    case F_TYPE:
        return it.t == T_STR ? str_value(&it) : NULL;
    case F_PARENT:
        if (it.t == T_NIL) return Py_NewRef(Py_None);
        return it.t == T_UINT ? PyLong_FromUnsignedLongLong(it.u) : NULL;
    case F_BLOCK_SIZE:
        return it.t == T_UINT || it.t == T_NEG ? int_object(&it) : NULL;
    case F_LORA_ID: case F_GROUP: case F_WINDOW:
        if (it.t == T_NIL) return Py_NewRef(Py_None);
        return it.t == T_UINT || it.t == T_NEG ? int_object(&it) : NULL;
    case F_MEDIUM: case F_LORA_NAME: case F_KIND: case F_LOCALITY: case F_OWNERSHIP:
    case F_SESSION:
        if (it.t == T_NIL) return Py_NewRef(Py_None);
        return it.t == T_STR ? str_value(&it) : NULL;
    case F_EXTRA: /* nil, or one nil per block: the count */
        if (it.t == T_NIL) return Py_NewRef(Py_None);
        if (it.t != T_ARR || it.n > (size_t)(c->end - c->p)) return NULL;
        for (size_t i = 0; i < it.n; i++) {
            item x;
            if (next_item(c, &x) < 0 || x.t != T_NIL) return NULL;
        }
        return PyLong_FromSize_t(it.n);
    case F_LOOKAHEAD:
        return it.t == T_NIL ? Py_NewRef(Py_None) : NULL;
    }
    return NULL;
}

static int
event_kind(PyObject *type)
{
    static const char *const NAMES[3] = {"BlockStored", "BlockRemoved", "AllBlocksCleared"};
    for (int k = 0; k < 3; k++) {
        if (PyUnicode_CompareWithASCIIString(type, NAMES[k]) == 0) {
            return k;
        }
    }
    return -1;
}

/* The record of one map-encoded event: (0, hashes, parent, tokens, block_size, lora_id,
 * medium, lora_name, extra_count, group_idx, spec_kind, window, locality, ownership,
 * session_id) | (1, hashes, medium, group_idx, locality, ownership) | (2,).
 * NULL with an error set: out of memory; NULL without: bail. */
static PyObject *
event_record(cursor *c)
{
    item m;
    if (next_item(c, &m) < 0 || m.t != T_MAP || m.n > F_COUNT) {
        return NULL;
    }
    PyObject *vals[F_COUNT] = {NULL};
    PyObject *out = NULL;
    unsigned seen = 0;
    for (size_t i = 0; i < m.n; i++) {
        item key;
        if (next_item(c, &key) < 0) goto done;
        int f = field_of(&key);
        if (f < 0 || (seen & BIT(f))) goto done; /* unknown or repeated key */
        vals[f] = field_value(c, f);
        if (vals[f] == NULL) {
            if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) PyErr_Clear();
            goto done;
        }
        seen |= BIT(f);
    }
    if (!(seen & BIT(F_TYPE))) goto done;
    int kind = event_kind(vals[F_TYPE]);
    if (kind < 0 || (seen & ~ALLOWED[kind]) || (seen & REQUIRED[kind]) != REQUIRED[kind]) {
        goto done;
    }
    static const int STORED[] = {F_HASHES, F_PARENT, F_TOKENS, F_BLOCK_SIZE, F_LORA_ID,
                                 F_MEDIUM, F_LORA_NAME, F_EXTRA, F_GROUP, F_KIND, F_WINDOW,
                                 F_LOCALITY, F_OWNERSHIP, F_SESSION};
    static const int REMOVED[] = {F_HASHES, F_MEDIUM, F_GROUP, F_LOCALITY, F_OWNERSHIP};
    const int *order = kind == KIND_STORED ? STORED : REMOVED;
    Py_ssize_t n = kind == KIND_STORED ? 14 : kind == KIND_REMOVED ? 5 : 0;
    out = PyTuple_New(n + 1);
    if (out == NULL) goto done;
    PyTuple_SET_ITEM(out, 0, PyLong_FromLong(kind));
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *v = vals[order[j]];
        PyTuple_SET_ITEM(out, j + 1, v == NULL ? Py_NewRef(Py_None) : Py_NewRef(v));
    }
done:
    for (int f = 0; f < F_COUNT; f++) {
        Py_XDECREF(vals[f]);
    }
    return out;
}

PyObject *
ingest_decode_batch(PyObject *module, PyObject *arg)
{
    (void)module;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    cursor c = {(const unsigned char *)view.buf, (const unsigned char *)view.buf + view.len};
    PyObject *records = NULL, *dp = NULL, *out = NULL;
    size_t top, nev;
    item ts, rank = {.t = T_NIL};
    if (next_array(&c, &top) < 0 || top < 2 || top > 3) goto bail;
    if (next_item(&c, &ts) < 0 || ts.t != T_FLOAT) goto bail;
    if (next_array(&c, &nev) < 0) goto bail;
    records = PyList_New((Py_ssize_t)nev);
    if (records == NULL) goto fail;
    for (size_t i = 0; i < nev; i++) {
        PyObject *rec = event_record(&c);
        if (rec == NULL) {
            if (PyErr_Occurred()) goto fail;
            goto bail;
        }
        PyList_SET_ITEM(records, (Py_ssize_t)i, rec);
    }
    if (top == 3 && (next_item(&c, &rank) < 0 ||
                     (rank.t != T_NIL && rank.t != T_UINT && rank.t != T_NEG))) {
        goto bail;
    }
    if (c.p != c.end) goto bail; /* trailing bytes */
    dp = rank.t == T_NIL ? Py_NewRef(Py_None) : int_object(&rank);
    if (dp == NULL) goto fail;
    out = Py_BuildValue("(dOO)", ts.f, dp, records);
    goto fail; /* releases what `out` does not own */
bail:
    out = Py_NewRef(Py_None);
fail:
    Py_XDECREF(records);
    Py_XDECREF(dp);
    PyBuffer_Release(&view);
    return out;
}

/* ------------------------------------------------------------------ residency */

/* A residency or hash-map table: a tuple of SLOTS dicts (indexer/staggered.py). */
static int
check_table(PyObject *t, const char *what)
{
    if (!PyTuple_CheckExact(t) || PyTuple_GET_SIZE(t) != SLOTS) {
        PyErr_Format(PyExc_TypeError, "%s must be a tuple of %d dicts", what, SLOTS);
        return -1;
    }
    return 0;
}

static PyObject *
slot_dict(PyObject *table, uint64_t slot)
{
    PyObject *d = PyTuple_GET_ITEM(table, (Py_ssize_t)(slot & (SLOTS - 1)));
    if (!PyDict_Check(d)) {
        PyErr_SetString(PyExc_TypeError, "table slot is not a dict");
        return NULL;
    }
    return d;
}

/* An engine's hash map: a U64Map (indexer/u64map.py). */
static int
check_map(PyObject *m, const char *what)
{
    if (!U64Map_Check(m)) {
        PyErr_Format(PyExc_TypeError, "%s must be a U64Map", what);
        return -1;
    }
    return 0;
}

typedef struct {
    PyObject *obj; /* the engine's bit, 1 << slot */
    uint64_t u;    /* the same when it fits 64 bits */
    int fits;
} engine_bit;

static int
bit_open(engine_bit *b, PyObject *obj)
{
    if (!PyLong_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "bit must be an int");
        return -1;
    }
    b->obj = obj;
    b->u = PyLong_AsUnsignedLongLong(obj);
    b->fits = !(b->u == (uint64_t)-1 && PyErr_Occurred());
    PyErr_Clear();
    return 0;
}

/* m & bit != 0: 1, 0, or -1 with an error. */
static int
mask_has(PyObject *m, const engine_bit *b)
{
    if (b->fits && PyLong_Check(m)) {
        /* The low 64 bits in two's complement: enough for a bit below 2**64. */
        return (PyLong_AsUnsignedLongLongMask(m) & b->u) != 0;
    }
    PyObject *r = PyNumber_And(m, b->obj);
    if (r == NULL) {
        return -1;
    }
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* m | bit (m NULL: absent), or m & ~bit (clear). A new reference. */
static PyObject *
mask_with(PyObject *m, const engine_bit *b, int clear)
{
    if (m == NULL) {
        return Py_NewRef(b->obj);
    }
    if (b->fits && PyLong_Check(m)) {
        uint64_t v = PyLong_AsUnsignedLongLong(m);
        if (!(v == (uint64_t)-1 && PyErr_Occurred())) {
            v = clear ? v & ~b->u : v | b->u;
            /* A block one engine holds shares that engine's bit object: no int per block. */
            return v == b->u ? Py_NewRef(b->obj) : PyLong_FromUnsignedLongLong(v);
        }
        PyErr_Clear(); /* beyond 64 bits: Python's operators */
    }
    if (!clear) {
        return PyNumber_Or(m, b->obj);
    }
    PyObject *inv = PyNumber_Invert(b->obj);
    if (inv == NULL) {
        return NULL;
    }
    PyObject *r = PyNumber_And(m, inv);
    Py_DECREF(inv);
    return r;
}

static inline uint64_t
load_le(const unsigned char *p, int width)
{
    uint64_t v = 0;
    for (int k = width - 1; k >= 0; k--) {
        v = (v << 8) | p[k];
    }
    return v;
}

/* Content keys at the end of each block: xxh3 chained per unit (indexer/keys.py). */
static void
block_keys(uint64_t seed, const unsigned char *tokens, Py_ssize_t nblocks, Py_ssize_t unit,
           Py_ssize_t step, uint64_t *out)
{
    uint64_t key = seed;
    size_t ubytes = (size_t)unit * 4u;
    for (Py_ssize_t b = 0; b < nblocks; b++) {
        for (Py_ssize_t s = 0; s < step; s++, tokens += ubytes) {
            key = XXH3_64bits_withSeed(tokens, ubytes, (XXH64_hash_t)key);
        }
        out[b] = key;
    }
}

enum { RES_UNTOUCHED, RES_INSERTED, RES_UPDATED };

typedef struct {
    PyObject *k, *m; /* content key, mask before (RES_UPDATED) */
    PyObject *d;     /* k's dict (borrowed) */
    uint64_t h;      /* engine hash */
    int mapped;      /* h -> k inserted into the hash map */
    int res;         /* what happened to k in d */
} pending_block;

static void
release_blocks(pending_block *pb, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(pb[i].k);
        Py_XDECREF(pb[i].m);
    }
    PyMem_Free(pb);
}

/* Python's Ingest._is_reannounce for a single full-attention group: 1 re-announce, 0 not,
 * STORE_BAIL when Python must judge (block 0 is held: the whole range must be checked). */
static int
reannounce(PyObject *decided, PyObject *res, const engine_bit *b, const uint64_t *keys,
           Py_ssize_t nblocks)
{
    PyObject *dk = PyLong_FromUnsignedLongLong(keys[nblocks - 1]);
    if (dk == NULL) return -3;
    int verdict = -3;
    PyObject *v = PyDict_GetItemWithError(decided, dk);
    if (v != NULL) {
        verdict = PyObject_IsTrue(v) ? 1 : 0;
        goto out;
    }
    if (PyErr_Occurred()) goto out;
    PyObject *k0 = PyLong_FromUnsignedLongLong(keys[0]);
    PyObject *d = k0 == NULL ? NULL : slot_dict(res, keys[0]);
    PyObject *m = d == NULL ? NULL : PyDict_GetItemWithError(d, k0);
    Py_XDECREF(k0);
    if (PyErr_Occurred()) goto out;
    int held = m == NULL ? 0 : mask_has(m, b);
    if (held < 0) goto out;
    if (held) {
        verdict = STORE_BAIL;
    } else {
        verdict = PyDict_SetItem(decided, dk, Py_False) < 0 ? -3 : 0;
    }
out:
    Py_DECREF(dk);
    return verdict;
}

/* Take back what insert_blocks did to blocks [0, n), last first. */
static void
undo_blocks(pending_block *pb, PyObject *hmap, Py_ssize_t n)
{
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        pending_block *p = &pb[i];
        /* Deleting a key just inserted, or re-setting a present one, allocates nothing. */
        if (p->res == RES_INSERTED) {
            (void)PyDict_DelItem(p->d, p->k);
        } else if (p->res == RES_UPDATED) {
            (void)PyDict_SetItem(p->d, p->k, p->m);
        }
        if (p->mapped) {
            (void)u64map_remove(hmap, p->h);
        }
    }
}

/* Whether a block needs a rarer rule of the Python path, found before anything changes: its
 * hash is mapped already (extra references) or the engine holds its key already (a duplicate).
 * Taking changes back would not do: a segment grown meanwhile stays grown, and the map's order
 * (snapshots list it) would then differ from the Python path's. 1 yes, 0 no, -3 error. */
static int
needs_python(PyObject *res, PyObject *hmap, const engine_bit *b, const unsigned char *hashes,
             const uint64_t *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t v;
        int where = u64map_find(hmap, load_le(hashes + 8 * i, 8), &v);
        if (where != U64_ABSENT) return where < 0 ? -3 : 1;
        PyObject *k = PyLong_FromUnsignedLongLong(keys[i]);
        PyObject *d = k == NULL ? NULL : slot_dict(res, keys[i]);
        PyObject *m = d == NULL ? NULL : PyDict_GetItemWithError(d, k);
        Py_XDECREF(k);
        if (PyErr_Occurred()) return -3;
        int held = m == NULL ? 0 : mask_has(m, b);
        if (held) return held < 0 ? -3 : 1;
    }
    return 0;
}

/* Record every block: its engine hash mapped to its key, its entry or'ed with the engine's bit
 * (one lookup each: set-if-absent). needs_python has ruled out the rarer cases but one: a hash
 * or key listed twice in the event; that is taken back and STORE_BAIL returned. 0 when done,
 * -3 with an error set. The maps end up as Residency.add_many leaves them: same entries, each
 * inserted in block order. */
static int
insert_blocks(pending_block *pb, PyObject *res, PyObject *hmap, const engine_bit *b,
              const unsigned char *hashes, const uint64_t *keys, Py_ssize_t n)
{
    Py_ssize_t i;
    int code = 0;
    for (i = 0; i < n && code == 0; i++) {
        pending_block *p = &pb[i];
        p->h = load_le(hashes + 8 * i, 8);
        p->k = PyLong_FromUnsignedLongLong(keys[i]);
        if (p->k == NULL || (p->d = slot_dict(res, keys[i])) == NULL) {
            return -3;
        }
        uint64_t old;
        int put = u64map_put_new(hmap, p->h, keys[i], &old);
        if (put < 0) return -3;
        if (put != 1) { /* mapped by an earlier block of this very event */
            code = STORE_BAIL;
            break;
        }
        p->mapped = 1;
        PyObject *got;
        Py_ssize_t before = PyDict_GET_SIZE(p->d);
        got = PyDict_SetDefault(p->d, p->k, b->obj);
        if (got == NULL) return -3;
        if (PyDict_GET_SIZE(p->d) != before) {
            p->res = RES_INSERTED;
            continue;
        }
        int held = mask_has(got, b);
        if (held) {
            if (held < 0) return -3;
            code = STORE_BAIL; /* a duplicate */
            break;
        }
        PyObject *m = mask_with(got, b, 0);
        p->m = Py_NewRef(got);
        if (m == NULL || PyDict_SetItem(p->d, p->k, m) < 0) {
            Py_XDECREF(m);
            return -3;
        }
        Py_DECREF(m);
        p->res = RES_UPDATED;
    }
    if (code == STORE_BAIL) {
        undo_blocks(pb, hmap, i + 1);
    }
    return code;
}

PyObject *
ingest_store_dense(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "store_dense() takes exactly 10 arguments");
        return NULL;
    }
    PyObject *res = args[0], *hmap = args[1], *seed_obj = args[3], *parent = args[4];
    PyObject *decided = args[9];
    engine_bit b;
    if (check_table(res, "res") < 0 || check_map(hmap, "hmap") < 0 || bit_open(&b, args[2]) < 0) {
        return NULL;
    }
    if (!PyBytes_Check(args[5]) || !PyBytes_Check(args[6]) ||
        (decided != Py_None && !PyDict_Check(decided))) {
        PyErr_SetString(PyExc_TypeError, "store_dense: hashes and tokens are bytes");
        return NULL;
    }
    Py_ssize_t unit = PyLong_AsSsize_t(args[7]), bs = PyLong_AsSsize_t(args[8]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyBytes_GET_SIZE(args[5]) / 8;
    if (unit <= 0 || bs <= 0 || bs % unit || n == 0 || PyBytes_GET_SIZE(args[6]) / 4 / bs != n) {
        PyErr_SetString(PyExc_ValueError, "store_dense: not a dense event of whole units");
        return NULL;
    }
    PyObject *mapped = NULL;
    if (parent != Py_None) {
        seed_obj = mapped = u64map_get_object(hmap, parent);
        if (seed_obj == NULL) {
            return PyErr_Occurred() ? NULL : PyLong_FromLong(STORE_BAIL); /* unknown parent */
        }
    }
    uint64_t seed = PyLong_AsUnsignedLongLongMask(seed_obj);
    Py_XDECREF(mapped);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) return NULL;
    uint64_t *keys = PyMem_Malloc((size_t)n * sizeof(uint64_t));
    pending_block *pb = PyMem_Calloc((size_t)n, sizeof(pending_block));
    if (keys == NULL || pb == NULL) {
        PyMem_Free(keys);
        PyMem_Free(pb);
        return PyErr_NoMemory();
    }
    block_keys(seed, (const unsigned char *)PyBytes_AS_STRING(args[6]), n, unit, bs / unit, keys);
    int code = 0;
    if (decided != Py_None) {
        code = reannounce(decided, res, &b, keys, n);
        if (code == 1) code = STORE_REANNOUNCED;
    }
    if (code == 0) {
        code = needs_python(res, hmap, &b, (const unsigned char *)PyBytes_AS_STRING(args[5]), keys, n);
        if (code == 1) code = STORE_BAIL;
    }
    if (code == 0) {
        code = insert_blocks(pb, res, hmap, &b, (const unsigned char *)PyBytes_AS_STRING(args[5]),
                             keys, n);
    }
    PyMem_Free(keys);
    release_blocks(pb, n);
    if (code == -3) return NULL;
    return PyLong_FromSsize_t(code == 0 ? n : code);
}

/* One engine hash of a removal; returns 1 removed, 0 unknown, -1 error; *cleared += 1 when
 * the engine's residency entry went (not just a duplicate copy). */
static int
remove_one(PyObject *res, PyObject *hmap, const engine_bit *b, PyObject *h, PyObject *dups,
           PyObject *extra_refs, PyObject *prefix, int *cleared)
{
    uint64_t hu = PyLong_AsUnsignedLongLong(h), ku;
    if (hu == (uint64_t)-1 && PyErr_Occurred()) return -1;
    int where = u64map_find(hmap, hu, &ku);
    if (where < 0) return -1;
    if (where == U64_ABSENT || res == Py_None) return 0;
    PyObject *key = where == U64_NATIVE ? PyLong_FromUnsignedLongLong(ku)
                                        : u64map_get_object(hmap, h);
    if (key == NULL) return -1;
    int rc = -1;
    PyObject *dk = NULL, *d = slot_dict(res, PyLong_AsUnsignedLongLongMask(key));
    if (d == NULL || PyErr_Occurred()) goto out;
    PyObject *m = PyDict_GetItemWithError(d, key);
    if (m == NULL && PyErr_Occurred()) goto out;
    int held = m == NULL ? 0 : mask_has(m, b);
    if (held <= 0) {
        rc = held;
        goto out;
    }
    PyObject *extra = NULL;
    if (PyDict_GET_SIZE(dups)) {
        dk = PyTuple_Pack(4, PyTuple_GET_ITEM(prefix, 0), PyTuple_GET_ITEM(prefix, 1),
                          PyTuple_GET_ITEM(prefix, 2), key);
        if (dk == NULL) goto out;
        extra = PyDict_GetItemWithError(dups, dk);
        if (extra == NULL && PyErr_Occurred()) goto out;
    }
    int has_extra = extra == NULL ? 0 : PyObject_IsTrue(extra);
    if (has_extra < 0) goto out;
    if (has_extra) { /* a duplicate copy goes first */
        long left = PyLong_AsLong(extra) - 1;
        if (PyErr_Occurred()) goto out;
        PyObject *lo = left ? PyLong_FromLong(left) : NULL;
        if (left ? lo == NULL || PyDict_SetItem(dups, dk, lo) < 0 : PyDict_DelItem(dups, dk) < 0) {
            Py_XDECREF(lo);
            goto out;
        }
        Py_XDECREF(lo);
    } else {
        PyObject *nm = mask_with(m, b, 1);
        if (nm == NULL) goto out;
        int st = PyObject_IsTrue(nm) ? PyDict_SetItem(d, key, nm) : PyDict_DelItem(d, key);
        Py_DECREF(nm);
        if (st < 0) goto out;
        *cleared += 1;
    }
    PyObject *refs = PyDict_GET_SIZE(extra_refs) ? PyDict_GetItemWithError(extra_refs, h) : NULL;
    if (refs == NULL) {
        rc = PyErr_Occurred() || u64map_remove(hmap, hu) < 0 ? -1 : 1;
        goto out;
    }
    long r = PyLong_AsLong(refs);
    if (r == -1 && PyErr_Occurred()) goto out;
    PyObject *ro = r == 1 ? NULL : PyLong_FromLong(r - 1);
    int st = r == 1 ? PyDict_DelItem(extra_refs, h)
                    : ro == NULL ? -1 : PyDict_SetItem(extra_refs, h, ro);
    Py_XDECREF(ro);
    rc = st < 0 ? -1 : 1;
out:
    Py_XDECREF(dk);
    Py_DECREF(key);
    return rc;
}

PyObject *
ingest_remove_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "remove_hashes() takes exactly 8 arguments");
        return NULL;
    }
    PyObject *res = args[0], *hmap = args[1], *hashes = args[3], *dups = args[4];
    PyObject *extra_refs = args[5], *prefix = args[6], *sink = args[7];
    engine_bit b;
    if ((res != Py_None && check_table(res, "res") < 0) || check_map(hmap, "hmap") < 0 ||
        bit_open(&b, args[2]) < 0) {
        return NULL;
    }
    if (!PyBytes_Check(hashes) || !PyDict_Check(dups) || !PyDict_Check(extra_refs) ||
        !PyTuple_Check(prefix) || PyTuple_GET_SIZE(prefix) != 3 ||
        (sink != Py_None && !PySet_Check(sink))) {
        PyErr_SetString(PyExc_TypeError, "remove_hashes: bad argument types");
        return NULL;
    }
    Py_ssize_t n = PyBytes_GET_SIZE(hashes) / 8, removed = 0, unknown = 0;
    int cleared = 0;
    const unsigned char *hp = (const unsigned char *)PyBytes_AS_STRING(hashes);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = PyLong_FromUnsignedLongLong(load_le(hp + 8 * i, 8));
        if (h == NULL) return NULL;
        int rc = remove_one(res, hmap, &b, h, dups, extra_refs, prefix, &cleared);
        if (rc == 0) {
            unknown++;
            if (sink != Py_None && PySet_Add(sink, h) < 0) rc = -1;
        }
        Py_DECREF(h);
        if (rc < 0) return NULL;
        removed += rc;
    }
    return Py_BuildValue("(nni)", removed, unknown, cleared);
}
