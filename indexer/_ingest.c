/*
 * The event plane's hot path in C, part of indexer._native (indexer/ingest.py decides when it
 * applies; the Python code it mirrors is the reference):
 *
 *   decode_batch(payload)       -> (ts, dp_rank, records) | None
 *       vLLM's msgpack EventBatch in its common shape (map-encoded events, known keys only,
 *       int hashes) into one tuple per event, hashes and token ids left as packed bytes:
 *       no Python object per block. None for anything else; the Python decoder then decides.
 *
 * Applying the records (store_dense, remove_hashes) is indexer/_residency.c's.
 *
 * Bound: input is read through bounds-checked cursors only; an array header may not announce
 * more elements than bytes remain, so a lying header allocates nothing large.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_ingest.h"

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
    static size_t lens[F_COUNT];
    if (lens[0] == 0) {
        for (int f = 0; f < F_COUNT; f++) lens[f] = strlen(FIELD_NAMES[f]);
    }
    for (int f = 0; f < F_COUNT; f++) {
        if (lens[f] == key->n && memcmp(FIELD_NAMES[f], key->s, key->n) == 0) {
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

/* One unsigned msgpack int at p (a positive fixint or uint 8/16/32/64) when at least 9 bytes
 * remain: one unaligned 8-byte load, whatever the width, so token ids of mixed widths cost no
 * mispredicted byte loop. Returns the bytes consumed, 0 when it is not that shape. */
static inline size_t
fast_uint(const unsigned char *p, const unsigned char *end, uint64_t *v)
{
    unsigned tag = *p;
    if (tag <= 0x7f) {
        *v = tag;
        return 1;
    }
    if (tag < 0xcc || tag > 0xcf || end - p < 9) {
        return 0;
    }
    unsigned width = 1u << (tag - 0xcc);
    uint64_t raw;
    memcpy(&raw, p + 1, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    raw = __builtin_bswap64(raw);
#else
    raw = be(p + 1, 8);
#endif
    *v = width == 8 ? raw : raw >> (64 - 8 * width);
    return 1 + width;
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
    const unsigned char *p = c->p, *end = c->end;
    for (size_t i = 0; i < n; i++, w += width) {
        uint64_t v;
        /* The unsigned encodings inline (every token id and hash vLLM sends); the rest, such
         * as a non-negative value in a signed encoding or the payload's last bytes, through
         * next_item. */
        size_t used = p < end ? fast_uint(p, end, &v) : 0;
        if (used) {
            p += used;
        } else {
            item it;
            c->p = p;
            if (next_item(c, &it) < 0 || it.t != T_UINT) {
                goto bail;
            }
            p = c->p;
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
    c->p = p;
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
    out = PyTuple_New(n + 1 + (kind == KIND_REMOVED));
    if (out == NULL) goto done;
    PyTuple_SET_ITEM(out, 0, PyLong_FromLong(kind));
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *v = vals[order[j]];
        PyTuple_SET_ITEM(out, j + 1, v == NULL ? Py_NewRef(Py_None) : Py_NewRef(v));
    }
    if (kind == KIND_REMOVED) PyTuple_SET_ITEM(out, n + 1, PyLong_FromLong(1)); /* events */
done:
    for (int f = 0; f < F_COUNT; f++) {
        Py_XDECREF(vals[f]);
    }
    return out;
}

/* vLLM sends every block its GPU pool evicts as its own one-hash BlockRemoved, about one per
 * block stored once caches are full. A run of such events with the same medium, group,
 * locality and ownership becomes one record, (REMOVED, hashes, medium, group_idx, locality,
 * ownership, n): n events of one hash each, in order, without a tuple and a bytes object per
 * evicted block (a removal record of any other event has n = 1 and all its hashes). */
typedef struct {
    PyObject *first; /* the run's first record (its fields), or NULL: no run */
    uint64_t inline_buf[16];
    uint64_t *hashes; /* inline_buf, or PyMem while the run is longer */
    Py_ssize_t n, cap;
    /* The first event's bytes in the payload, [p0, end), its hash at [h0, h1); p0 NULL: the
     * run is extended only through records. */
    const unsigned char *p0, *h0, *h1, *end;
} removal_run;

/* The event at c when it is a map whose "block_hashes" is an array of one unsigned int and
 * whose other values are scalars: 1, c past it, *h0 / *h1 the hash's bytes, *hash its value.
 * 0 otherwise (c where it was). Only shapes, no objects: a candidate for extends_run. */
static int
scan_single(cursor *c, const unsigned char **h0, const unsigned char **h1, uint64_t *hash)
{
    cursor at = *c;
    item m;
    int found = 0;
    if (next_item(&at, &m) < 0 || m.t != T_MAP || m.n > F_COUNT) return 0;
    for (size_t i = 0; i < m.n; i++) {
        item key, v;
        if (next_item(&at, &key) < 0 || key.t != T_STR) return 0;
        if (key.n == 12 && memcmp(key.s, "block_hashes", 12) == 0) {
            size_t n;
            if (found || next_array(&at, &n) < 0 || n != 1) return 0;
            *h0 = at.p;
            if (next_item(&at, &v) < 0 || v.t != T_UINT) return 0;
            *h1 = at.p, *hash = v.u, found = 1;
        } else if (next_item(&at, &v) < 0 || v.t == T_ARR || v.t == T_MAP || v.t == T_EXT) {
            return 0;
        }
    }
    if (!found) return 0;
    *c = at;
    return 1;
}

static int
same_fields(PyObject *a, PyObject *b)
{
    for (Py_ssize_t j = 2; j <= 5; j++) {
        PyObject *x = PyTuple_GET_ITEM(a, j), *y = PyTuple_GET_ITEM(b, j);
        if (x == y) continue;
        int eq = PyObject_RichCompareBool(x, y, Py_EQ);
        if (eq != 1) return eq; /* 0, or -1 with an error set */
    }
    return 1;
}

/* The run as one record (a new reference): its first event's record when it holds one event,
 * else that record's fields with every hash and n; NULL with an error set. */
static PyObject *
run_record(const removal_run *run)
{
    if (run->n == 1) return Py_NewRef(run->first);
    PyObject *rec = PyTuple_New(7);
    PyObject *hashes = PyBytes_FromStringAndSize((const char *)run->hashes,
                                                 run->n * (Py_ssize_t)sizeof(uint64_t));
    PyObject *n = PyLong_FromSsize_t(run->n);
    if (rec == NULL || hashes == NULL || n == NULL) {
        Py_XDECREF(rec), Py_XDECREF(hashes), Py_XDECREF(n);
        return NULL;
    }
    PyTuple_SET_ITEM(rec, 0, Py_NewRef(PyTuple_GET_ITEM(run->first, 0)));
    PyTuple_SET_ITEM(rec, 1, hashes);
    for (Py_ssize_t j = 2; j <= 5; j++) {
        PyTuple_SET_ITEM(rec, j, Py_NewRef(PyTuple_GET_ITEM(run->first, j)));
    }
    PyTuple_SET_ITEM(rec, 6, n);
    return rec;
}

/* Append the run as a record (records NULL: just drop it) and reset it. */
static int
end_run(removal_run *run, PyObject *records)
{
    int rc = 0;
    if (run->first != NULL && records != NULL) {
        PyObject *rec = run_record(run);
        rc = rec == NULL ? -1 : PyList_Append(records, rec);
        Py_XDECREF(rec);
    }
    Py_CLEAR(run->first);
    if (run->hashes != run->inline_buf) PyMem_Free(run->hashes);
    run->hashes = NULL;
    run->n = run->cap = 0;
    run->p0 = NULL;
    return rc;
}

/* Add hash h (packed little-endian, as a record holds it) to the run. */
static int
run_append(removal_run *run, uint64_t h)
{
    if (run->n == run->cap) {
        Py_ssize_t cap = run->cap * 2;
        uint64_t *grown = PyMem_Malloc((size_t)cap * sizeof(uint64_t));
        if (grown == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        memcpy(grown, run->hashes, (size_t)run->n * sizeof(uint64_t));
        if (run->hashes != run->inline_buf) PyMem_Free(run->hashes);
        run->hashes = grown, run->cap = cap;
    }
    run->hashes[run->n++] = h;
    return 0;
}

/* Whether the event at c is a one-hash removal whose bytes but the hash's equal the run's first
 * event's (so its fields are that event's, already checked): then its hash joins the run and c
 * moves past it, with no object made. */
static int
extends_run(removal_run *run, cursor *c)
{
    const unsigned char *p0 = c->p, *h0, *h1;
    uint64_t hash;
    if (run->p0 == NULL) return 0;
    cursor at = *c;
    if (!scan_single(&at, &h0, &h1, &hash)) return 0;
    size_t head = (size_t)(h0 - p0), tail = (size_t)(at.p - h1);
    if (head != (size_t)(run->h0 - run->p0) || tail != (size_t)(run->end - run->h1) ||
        memcmp(p0, run->p0, head) != 0 || memcmp(h1, run->h1, tail) != 0) {
        return 0;
    }
    unsigned char le[8];
    store_le(le, hash, 8);
    uint64_t h;
    memcpy(&h, le, sizeof h);
    if (run_append(run, h) < 0) return -1;
    *c = at;
    return 1;
}

/* Add one decoded record (borrowed) to records, through the run of one-hash removals. */
static int
add_record(removal_run *run, PyObject *records, PyObject *rec)
{
    int single = PyLong_AsLong(PyTuple_GET_ITEM(rec, 0)) == KIND_REMOVED &&
                 PyBytes_GET_SIZE(PyTuple_GET_ITEM(rec, 1)) == (Py_ssize_t)sizeof(uint64_t);
    if (single && run->first != NULL) {
        int same = same_fields(run->first, rec);
        if (same < 0) return -1;
        if (same) {
            uint64_t h;
            memcpy(&h, PyBytes_AS_STRING(PyTuple_GET_ITEM(rec, 1)), sizeof h);
            return run_append(run, h);
        }
    }
    if (end_run(run, records) < 0) return -1;
    if (!single) return PyList_Append(records, rec);
    run->first = Py_NewRef(rec);
    run->hashes = run->inline_buf, run->cap = 16, run->n = 1;
    memcpy(run->hashes, PyBytes_AS_STRING(PyTuple_GET_ITEM(rec, 1)), sizeof(uint64_t));
    return 0;
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
    removal_run run = {NULL, {0}, NULL, 0, 0, NULL, NULL, NULL, NULL};
    size_t top, nev;
    item ts, rank = {.t = T_NIL};
    if (next_array(&c, &top) < 0 || top < 2 || top > 3) goto bail;
    if (next_item(&c, &ts) < 0 || ts.t != T_FLOAT) goto bail;
    if (next_array(&c, &nev) < 0) goto bail;
    records = PyList_New(0);
    if (records == NULL) goto fail;
    for (size_t i = 0; i < nev; i++) {
        const unsigned char *p0 = c.p;
        int ext = extends_run(&run, &c);
        if (ext < 0) goto fail;
        if (ext) continue;
        PyObject *rec = event_record(&c);
        if (rec == NULL) {
            if (PyErr_Occurred()) goto fail;
            goto bail;
        }
        PyObject *was = run.first;
        int r = add_record(&run, records, rec);
        Py_DECREF(rec);
        if (r < 0) goto fail;
        if (run.first != NULL && run.first != was) { /* rec starts a run: note its bytes */
            cursor ev = {p0, c.p};
            uint64_t hash;
            if (scan_single(&ev, &run.h0, &run.h1, &hash) && ev.p == c.p) {
                run.p0 = p0, run.end = c.p;
            }
        }
    }
    if (end_run(&run, records) < 0) goto fail;
    if (top == 3 && (next_item(&c, &rank) < 0 ||
                     (rank.t != T_NIL && rank.t != T_UINT && rank.t != T_NEG))) {
        goto bail;
    }
    if (c.p != c.end) goto bail; /* trailing bytes */
    dp = rank.t == T_NIL ? Py_NewRef(Py_None) : int_object(&rank);
    if (dp == NULL) goto fail;
    out = Py_BuildValue("(dOOn)", ts.f, dp, records, (Py_ssize_t)nev);
    goto fail; /* releases what `out` does not own */
bail:
    out = Py_NewRef(Py_None);
fail:
    end_run(&run, NULL);
    Py_XDECREF(records);
    Py_XDECREF(dp);
    PyBuffer_Release(&view);
    return out;
}
