/*
 * The match path's loops in C, part of indexer._native (indexer/matching.py, indexer/keys.py).
 *
 *   token_keys(seed, tokens, unit, limit, packed)
 *       -> list[int] | bytes | None   indexer.keys.chain_keys straight from a list or tuple of
 *                                     token ids (no array of them is built first); packed: the
 *                                     keys as native uint64 bytes, with no int per key. None
 *                                     when an item is not an int (the Python path then raises).
 *   full_runs(table, keys, step, scan, block_size, nblocks, alive)
 *       -> list[int]                  hit_rules.full_attention_run for every engine of alive at
 *                                     once, by slot (bit position); the block loop and the
 *                                     per-engine results stay in C.
 *
 * The residency table (a U64Map) is read through residency_get only (see there). indexer/matching.py holds the Python
 * equivalents; the tests hold both to the same answers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_buffers.h"
#include "_u64map.h"

/* ------------------------------------------------------------------ residency access */

/* Whether `table` is a residency table this file can read. */
static int
residency_check(PyObject *table)
{
    if (!U64Map_Check(table)) {
        PyErr_Format(PyExc_TypeError, "residency table must be a U64Map, not %.100s",
                     Py_TYPE(table)->tp_name);
        return -1;
    }
    return 0;
}

/* Who holds the block whose key is `low` (64 bits; `key` is the same as an int, or NULL: made
 * here when needed): 0 nobody, 1 found with the low 64 bits of the engines' mask in *mask and,
 * when `wide` is not NULL, the whole mask as a new reference in *wide; -1 on error. A residency
 * table is a U64Map (indexer/_u64map.h): the common entry is read without a Python object; a
 * mask past 64 bits (engines past slot 63) sits in a side dict and is read as an int. */
static inline int
residency_get(PyObject *table, uint64_t low, PyObject *key, uint64_t *mask, PyObject **wide)
{
    uint64_t v;
    const int found = u64map_find(table, low, &v);
    if (found < 0) {
        return -1;
    }
    if (found == U64_ABSENT) {
        return 0;
    }
    if (found == U64_NATIVE) {
        *mask = v;
        if (wide != NULL && (*wide = PyLong_FromUnsignedLongLong((unsigned long long)v)) == NULL) {
            return -1;
        }
        return 1;
    }
    PyObject *made = NULL;
    if (key == NULL && (key = made = PyLong_FromUnsignedLongLong((unsigned long long)low)) == NULL) {
        return -1;
    }
    PyObject *m = u64map_get_object(table, key);
    Py_XDECREF(made);
    if (m == NULL) {
        return PyErr_Occurred() ? -1 : 0;
    }
    if (!PyLong_Check(m)) {
        Py_DECREF(m);
        PyErr_SetString(PyExc_TypeError, "residency masks must be ints");
        return -1;
    }
    *mask = (uint64_t)PyLong_AsUnsignedLongLongMask(m);
    if (wide != NULL) {
        *wide = m;
    } else {
        Py_DECREF(m);
    }
    return 1;
}

/* ------------------------------------------------------------------ token_keys */

static int
bad_tokens(void)
{
    PyErr_SetString(PyExc_ValueError, "token ids must be in [0, 2**32)");
    return -1;
}

/* How many items ahead pack_ids asks the cache for an int object: the objects lie wherever they
 * were allocated, and misses issued together overlap (the item pointers are read in order). */
#define ID_AHEAD 16

/* Items [start, start + count) of a list or tuple as uint32 into out: 0, 1 when an item is not
 * an int (the caller falls back), -1 with ValueError for an int outside [0, 2**32). */
static int
pack_ids(PyObject *seq, Py_ssize_t start, Py_ssize_t count, uint32_t *out)
{
    PyObject **items = PySequence_Fast_ITEMS(seq) + start;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *it = items[i];
        if (i + ID_AHEAD < count) {
            __builtin_prefetch(items[i + ID_AHEAD]);
        }
        if (!PyLong_Check(it)) {
            return 1;
        }
        unsigned long v;
#if PY_VERSION_HEX < 0x030C0000
        /* Ids below 2**30 are one digit: read it (CPython 3.11's int layout). */
        if (Py_SIZE(it) == 1) {
            out[i] = (uint32_t)((PyLongObject *)it)->ob_digit[0];
            continue;
        }
#else
        if (PyUnstable_Long_IsCompact((PyLongObject *)it)) {
            const Py_ssize_t c = PyUnstable_Long_CompactValue((PyLongObject *)it);
            if (c < 0 || c > 0xFFFFFFFF) {
                return bad_tokens();
            }
            out[i] = (uint32_t)c;
            continue;
        }
#endif
        v = PyLong_AsUnsignedLong(it);
        if (v == (unsigned long)-1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return -1;
            }
            PyErr_Clear();
            return bad_tokens();
        }
        if (v > 0xFFFFFFFFul) {
            return bad_tokens();
        }
        out[i] = (uint32_t)v;
    }
    return 0;
}

/* unit (> 0) and limit (None or >= 0) as chain_keys reads them; nkeys_max: whole units. */
static int
key_count(PyObject *unit_obj, PyObject *limit_obj, Py_ssize_t ntokens, Py_ssize_t *unit,
          Py_ssize_t *nkeys)
{
    int overflow = 0;
    const long long u = PyLong_AsLongLongAndOverflow(unit_obj, &overflow);
    if (u == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (overflow < 0 || (overflow == 0 && u <= 0)) {
        PyErr_SetString(PyExc_ValueError, "chain_keys: unit must be positive");
        return -1;
    }
    *unit = (overflow > 0 || u > ntokens) ? ntokens + 1 : (Py_ssize_t)u;
    *nkeys = ntokens / *unit;
    if (limit_obj != Py_None) {
        const long long lim = PyLong_AsLongLongAndOverflow(limit_obj, &overflow);
        if (lim == -1 && PyErr_Occurred()) {
            return -1;
        }
        if (overflow < 0 || (overflow == 0 && lim < 0)) {
            PyErr_SetString(PyExc_ValueError, "chain_keys: limit must not be negative");
            return -1;
        }
        if (overflow == 0 && lim < *nkeys) {
            *nkeys = (Py_ssize_t)lim;
        }
    }
    return 0;
}

/* Ids packed per pass: a chunk this size stays in the L1 cache between packing and hashing, and
 * a fresh array for a whole long prompt costs page faults on every call. */
#define PACK_IDS 4096

/* Where the keys go: a uint64 array (packed) or a list of ints. */
static int
put_key(PyObject *out, int packed, Py_ssize_t k, uint64_t key)
{
    if (packed) {
        memcpy(PyBytes_AS_STRING(out) + k * 8, &key, sizeof key);
        return 0;
    }
    PyObject *item = PyLong_FromUnsignedLongLong((unsigned long long)key);
    if (item == NULL) {
        return -1;
    }
    PyList_SET_ITEM(out, k, item);
    return 0;
}

/* The keys of token_keys into out (nkeys slots), packing the ids a chunk of whole units at a
 * time and hashing each chunk while it is in the cache; every id is checked, also those past
 * the last key. 0, 1 when an item is not an int, -1 with an error set. */
static int
hash_chunks(PyObject *tokens, uint64_t seed, Py_ssize_t unit, Py_ssize_t nkeys, int packed,
            PyObject *out)
{
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    const Py_ssize_t per = (nkeys > 0 && unit > PACK_IDS) ? unit : PACK_IDS - PACK_IDS % unit;
    const Py_ssize_t chunk = per > 0 ? per : PACK_IDS;
    uint32_t *ids = PyMem_Malloc((size_t)(chunk < n ? chunk : (n > 0 ? n : 1)) * 4u);
    if (ids == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    uint64_t key = seed;
    Py_ssize_t k = 0;
    int rc = 0;
    for (Py_ssize_t start = 0; rc == 0 && start < n; start += chunk) {
        const Py_ssize_t count = n - start < chunk ? n - start : chunk;
        rc = pack_ids(tokens, start, count, ids);
        const unsigned char *p = (const unsigned char *)ids;
        for (Py_ssize_t u = 0; rc == 0 && k < nkeys && u + unit <= count; u += unit, k++) {
            key = XXH3_64bits_withSeed(p + u * 4, (size_t)unit * 4u, (XXH64_hash_t)key);
            rc = put_key(out, packed, k, key);
        }
    }
    PyMem_Free(ids);
    return rc;
}

static PyObject *
token_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "token_keys() takes 5 arguments (seed, tokens, unit, limit, packed)");
        return NULL;
    }
    PyObject *tokens = args[1];
    if (!PyList_CheckExact(tokens) && !PyTuple_CheckExact(tokens)) {
        Py_RETURN_NONE;
    }
    const int packed = PyObject_IsTrue(args[4]);
    if (packed < 0) {
        return NULL;
    }
    /* The same reduction as python-xxhash's seed (any int modulo 2**64). */
    const uint64_t seed = (uint64_t)PyLong_AsUnsignedLongLongMask(args[0]);
    if (seed == (uint64_t)-1 && PyErr_Occurred()) {
        return NULL;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(tokens);
    Py_ssize_t unit = 1, nkeys = 0;
    if (key_count(args[2], args[3], n, &unit, &nkeys) < 0) {
        /* Every id is checked, as tokens_to_bytes does, before unit and limit (its order). */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        const int rc = hash_chunks(tokens, seed, 1, 0, 1, NULL);
        if (rc == 0) {
            PyErr_Restore(type, value, tb);
            return NULL;
        }
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return rc == 1 ? Py_NewRef(Py_None) : NULL;
    }
    PyObject *out = packed ? PyBytes_FromStringAndSize(NULL, nkeys * 8) : PyList_New(nkeys);
    if (out == NULL) {
        return NULL;
    }
    const int rc = hash_chunks(tokens, seed, unit, nkeys, packed, out);
    if (rc != 0) {
        Py_DECREF(out);
        return rc == 1 ? Py_NewRef(Py_None) : NULL;
    }
    return out;
}

/* ------------------------------------------------------------------ full_runs */

/* Keys as the walk reads them: a 1-D native uint64 buffer (array('Q')), else a list or tuple
 * of ints used in place. */
typedef struct {
    Py_buffer view;
    int has_view;
    PyObject *seq;
    Py_ssize_t len;
} walk_keys;

static int
walk_keys_open(walk_keys *k, PyObject *obj)
{
    k->has_view = 0;
    k->seq = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &k->view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) {
            return -1;
        }
        if (is_u64_vector(&k->view)) {
            k->has_view = 1;
            k->len = k->view.shape[0];
            return 0;
        }
        PyBuffer_Release(&k->view);
        PyErr_SetString(PyExc_TypeError, "keys must be a list of ints or a uint64 buffer");
        return -1;
    }
    if (!PyList_CheckExact(obj) && !PyTuple_CheckExact(obj)) {
        PyErr_SetString(PyExc_TypeError, "keys must be a list of ints or a uint64 buffer");
        return -1;
    }
    k->seq = Py_NewRef(obj);
    k->len = PySequence_Fast_GET_SIZE(obj);
    return 0;
}

static void
walk_keys_close(walk_keys *k)
{
    if (k->has_view) {
        PyBuffer_Release(&k->view);
    }
    Py_XDECREF(k->seq);
}

/* The low 64 bits of the int `o`, as PyLong_AsUnsignedLongLongMask gives them (never fails for
 * an int). A key is up to three 30-bit digits in CPython 3.11's layout: read them inline, as
 * the walk reads one key per block. */
static inline uint64_t
int_low64(PyObject *o)
{
#if PY_VERSION_HEX < 0x030C0000
    const Py_ssize_t size = Py_SIZE(o);
    if (PyLong_CheckExact(o) && size >= 0 && size <= 3) {
        const digit *d = ((PyLongObject *)o)->ob_digit;
        uint64_t v = 0;
        for (Py_ssize_t j = size - 1; j >= 0; j--) {
            v = (v << PyLong_SHIFT) | d[j];
        }
        return v;
    }
#endif
    return (uint64_t)PyLong_AsUnsignedLongLongMask(o);
}

/* Key i: its low 64 bits in *low, and the int itself in *obj (borrowed; NULL when the keys
 * are a buffer: residency_get makes one if it needs one). -1 with an error set. */
static inline int
walk_key(const walk_keys *k, Py_ssize_t i, uint64_t *low, PyObject **obj)
{
    if (k->has_view) {
        memcpy(low, (const char *)k->view.buf + i * 8, 8);
        *obj = NULL;
        return 0;
    }
    /* A list may shrink while a dict lookup runs Python code: read it bounds-checked. */
    if (i >= PySequence_Fast_GET_SIZE(k->seq)) {
        PyErr_SetString(PyExc_IndexError, "full_runs: keys changed size");
        return -1;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(k->seq, i);
    if (!PyLong_Check(item)) {
        PyErr_SetString(PyExc_TypeError, "full_runs: keys must be ints");
        return -1;
    }
    *low = int_low64(item);
    *obj = item;
    return 0;
}

/* How many blocks ahead the walk asks the cache for a key's place: a lookup misses the cache
 * (the table is far larger than it), and misses issued together overlap instead of queueing. */
#define WALK_AHEAD 24

/* Ask the cache for block b's place in table, if b is walked and its key is an exact int (a
 * hint only: never an error, never Python code). */
static inline void
walk_prefetch(const walk_keys *k, PyObject *table, Py_ssize_t b, Py_ssize_t step,
              Py_ssize_t scan)
{
    if (b >= scan) {
        return;
    }
    const Py_ssize_t i = (b + 1) * step - 1;
    uint64_t low;
    if (k->has_view) {
        memcpy(&low, (const char *)k->view.buf + i * 8, 8);
    }
    else {
        if (i >= PySequence_Fast_GET_SIZE(k->seq)) {
            return;
        }
        PyObject *item = PySequence_Fast_GET_ITEM(k->seq, i);
        if (!PyLong_CheckExact(item)) {
            return;
        }
        low = int_low64(item);
    }
    u64map_prefetch(table, low);
}

/* hits[slot] = value for every bit of the 64-bit word `bits` at word `w`. */
static int
set_slots(PyObject *hits, uint64_t bits, Py_ssize_t w, PyObject *value)
{
    while (bits) {
        const Py_ssize_t slot = w * 64 + __builtin_ctzll(bits);
        bits &= bits - 1;
        if (slot < PyList_GET_SIZE(hits)) {
            Py_INCREF(value);
            PyObject *old = PyList_GET_ITEM(hits, slot);
            PyList_SET_ITEM(hits, slot, value);
            Py_DECREF(old);
        }
    }
    return 0;
}

/* hits[slot] = tokens for every bit set in the (non-negative) Python int mask. */
static int
set_mask_slots(PyObject *hits, PyObject *mask, Py_ssize_t tokens)
{
    PyObject *value = PyLong_FromSsize_t(tokens);
    if (value == NULL) {
        return -1;
    }
    PyObject *rest = Py_NewRef(mask);
    PyObject *shift = PyLong_FromLong(64);
    int rc = shift == NULL ? -1 : 0;
    for (Py_ssize_t w = 0; rc == 0 && PyObject_IsTrue(rest) == 1; w++) {
        set_slots(hits, (uint64_t)PyLong_AsUnsignedLongLongMask(rest), w, value);
        PyObject *next = PyNumber_Rshift(rest, shift);
        Py_DECREF(rest);
        rest = next;
        if (rest == NULL) {
            rc = -1;
        }
    }
    Py_XDECREF(rest);
    Py_XDECREF(shift);
    Py_DECREF(value);
    return rc;
}

/* The walk with alive in 64 bits: blocks [0, scan) until every engine has dropped out. */
static int
walk64(PyObject *table, walk_keys *k, Py_ssize_t step, Py_ssize_t scan, Py_ssize_t bs,
       uint64_t alive, PyObject *hits, uint64_t *left)
{
    for (Py_ssize_t b = 0; b < WALK_AHEAD; b++) {
        walk_prefetch(k, table, b, step, scan);
    }
    for (Py_ssize_t b = 0; b < scan && alive; b++) {
        walk_prefetch(k, table, b + WALK_AHEAD, step, scan);
        uint64_t low, mask = 0;
        PyObject *key;
        if (walk_key(k, (b + 1) * step - 1, &low, &key) < 0) {
            return -1;
        }
        /* Held while the lookup runs: an int subclass's __eq__ may change the list. */
        Py_XINCREF(key);
        const int found = residency_get(table, low, key, &mask, NULL);
        Py_XDECREF(key);
        if (found < 0) {
            return -1;
        }
        const uint64_t now = alive & mask;
        if (now != alive) {
            PyObject *tokens = PyLong_FromSsize_t(b * bs);
            if (tokens == NULL) {
                return -1;
            }
            set_slots(hits, alive & ~now, 0, tokens);
            Py_DECREF(tokens);
            alive = now;
        }
    }
    *left = alive;
    return 0;
}

/* The walk with alive beyond 64 bits, in Python ints: returns the engines still running. */
static PyObject *
walk_wide(PyObject *table, walk_keys *k, Py_ssize_t step, Py_ssize_t scan, Py_ssize_t bs,
          PyObject *alive_obj, PyObject *hits)
{
    PyObject *alive = Py_NewRef(alive_obj);
    for (Py_ssize_t b = 0; b < WALK_AHEAD; b++) {
        walk_prefetch(k, table, b, step, scan);
    }
    for (Py_ssize_t b = 0; b < scan; b++) {
        walk_prefetch(k, table, b + WALK_AHEAD, step, scan);
        const int any = PyObject_IsTrue(alive);
        if (any <= 0) {
            if (any < 0) {
                goto fail;
            }
            break;
        }
        uint64_t low, mask;
        PyObject *key, *v = NULL;
        if (walk_key(k, (b + 1) * step - 1, &low, &key) < 0) {
            goto fail;
        }
        Py_XINCREF(key);
        const int found = residency_get(table, low, key, &mask, &v);
        Py_XDECREF(key);
        if (found < 0) {
            goto fail;
        }
        PyObject *now = found == 0 ? PyLong_FromLong(0) : PyNumber_And(alive, v);
        Py_XDECREF(v);
        if (now == NULL) {
            goto fail;
        }
        const int ne = PyObject_RichCompareBool(now, alive, Py_NE);
        if (ne != 0) {
            PyObject *inv = ne < 0 ? NULL : PyNumber_Invert(now);
            PyObject *dropped = inv == NULL ? NULL : PyNumber_And(alive, inv);
            Py_XDECREF(inv);
            const int rc = dropped == NULL ? -1 : set_mask_slots(hits, dropped, b * bs);
            Py_XDECREF(dropped);
            if (rc < 0) {
                Py_DECREF(now);
                goto fail;
            }
            Py_SETREF(alive, now);
            continue;
        }
        Py_DECREF(now);
    }
    return alive;
fail:
    Py_DECREF(alive);
    return NULL;
}

static PyObject *
full_runs(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "full_runs() takes 7 arguments "
                                         "(table, keys, step, scan, block_size, nblocks, alive)");
        return NULL;
    }
    PyObject *table = args[0], *alive_obj = args[6];
    Py_ssize_t nums[4];
    for (int i = 0; i < 4; i++) {
        nums[i] = PyLong_AsSsize_t(args[2 + i]);
        if (nums[i] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    const Py_ssize_t step = nums[0], scan = nums[1], bs = nums[2], nblocks = nums[3];
    if (residency_check(table) < 0) {
        return NULL;
    }
    if (!PyLong_Check(alive_obj) || step < 1 || scan < 0 || scan > nblocks) {
        PyErr_SetString(PyExc_ValueError, "full_runs: bad arguments");
        return NULL;
    }
    const int64_t nbits = (int64_t)_PyLong_NumBits(alive_obj);
    if (nbits < 0 || _PyLong_Sign(alive_obj) < 0) {
        PyErr_SetString(PyExc_ValueError, "full_runs: alive must be a non-negative int");
        return NULL;
    }
    walk_keys k;
    if (walk_keys_open(&k, args[1]) < 0) {
        return NULL;
    }
    if (scan > 0 && scan > k.len / step) {
        walk_keys_close(&k);
        PyErr_SetString(PyExc_IndexError, "full_runs: fewer keys than blocks to scan");
        return NULL;
    }
    PyObject *zero = PyLong_FromLong(0);
    PyObject *hits = zero == NULL ? NULL : PyList_New((Py_ssize_t)nbits);
    PyObject *survivors = NULL;
    if (hits != NULL) {
        for (Py_ssize_t i = 0; i < (Py_ssize_t)nbits; i++) {
            PyList_SET_ITEM(hits, i, Py_NewRef(zero));
        }
        if (nbits <= 64) {
            uint64_t left = 0;
            const uint64_t alive = (uint64_t)PyLong_AsUnsignedLongLongMask(alive_obj);
            if (walk64(table, &k, step, scan, bs, alive, hits, &left) == 0) {
                survivors = PyLong_FromUnsignedLongLong((unsigned long long)left);
            }
        }
        else {
            survivors = walk_wide(table, &k, step, scan, bs, alive_obj, hits);
        }
    }
    walk_keys_close(&k);
    Py_XDECREF(zero);
    if (survivors == NULL || set_mask_slots(hits, survivors, nblocks * bs) < 0) {
        Py_XDECREF(survivors);
        Py_XDECREF(hits);
        return NULL;
    }
    Py_DECREF(survivors);
    return hits;
}

/* ------------------------------------------------------------------ module */

static PyMethodDef match_methods[] = {
    {"token_keys", (PyCFunction)(void (*)(void))token_keys, METH_FASTCALL,
     "token_keys(seed, tokens, unit, limit, packed, /)\n--\n\n"
     "indexer.keys.chain_keys over a list or tuple of token ids; packed: native uint64 bytes.\n"
     "None when an item is not an int."},
    {"full_runs", (PyCFunction)(void (*)(void))full_runs, METH_FASTCALL,
     "full_runs(table, keys, step, scan, block_size, nblocks, alive, /)\n--\n\n"
     "Per slot of alive: tokens of its unbroken run of resident blocks (see\n"
     "indexer.matching.full_runs)."},
    {NULL, NULL, 0, NULL},
};

/* Adds the functions above to indexer._native (its exec slot): they read U64Map tables through
 * _u64map.h's C API, which lives in that extension. */
int
match_add_functions(PyObject *module)
{
    return PyModule_AddFunctions(module, match_methods);
}
