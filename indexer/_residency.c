/*
 * Stores in C, part of indexer._native (indexer/residency.py is the reference and decides
 * when these apply; removals are in indexer/_removal.c):
 *
 *   store_dense(res, hmap, bit, seed, parent, hashes, tokens, unit, block_size, decided)
 *       -> blocks added | BAIL | REANNOUNCED
 *       A dense full-attention BlockStored: chain its content keys and record it
 *       (Residency.add_many), or BAIL before changing anything when a rarer rule applies.
 *   store_run(res, hmap, bit, records, start, model_seed, unit, block_size, group, kind,
 *             window, resident, decided) -> (next, blocks added, re-announces)
 *       store_dense over the batch's records from `start` on, up to the first one that is not
 *       a plain store of the engine's only group or that store_dense leaves to Python: one
 *       call per batch instead of one per event.
 *
 * res (content key -> engine mask) and hmap (engine hash -> content key) are U64Maps
 * (indexer/u64map.py): their uint64 entries go through its C API, with no Python object per
 * block; a mask in a side dict (an engine past slot 63) goes through Python ints
 * (indexer/_masks.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_ingest.h"
#include "_masks.h"
#include "_u64map.h"

#define STORE_BAIL (-1)
#define STORE_REANNOUNCED (-2)
#define ERR (-3)

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

/* ------------------------------------------------------------------ store_dense */

/* Python's Ingest._is_reannounce for a single full-attention group: 1 re-announce, 0 not,
 * STORE_BAIL when Python must judge (block 0 is held: the whole range must be checked). */
static int
reannounce(PyObject *decided, PyObject *res, const engine_bit *b, const uint64_t *keys,
           Py_ssize_t nblocks)
{
    PyObject *dk = PyLong_FromUnsignedLongLong(keys[nblocks - 1]);
    if (dk == NULL) return ERR;
    int verdict = ERR;
    PyObject *v = PyDict_GetItemWithError(decided, dk);
    if (v != NULL) {
        verdict = PyObject_IsTrue(v) ? 1 : 0;
    } else if (!PyErr_Occurred()) {
        int h = held(res, keys[0], b);
        if (h > 0) {
            verdict = STORE_BAIL;
        } else if (h == 0) {
            verdict = PyDict_SetItem(decided, dk, Py_False) < 0 ? ERR : 0;
        }
    }
    Py_DECREF(dk);
    return verdict;
}


/* Ask the cache for block i's places in both maps (a hint only). */
static inline void
prefetch_block(PyObject *res, PyObject *hmap, const unsigned char *hashes, const uint64_t *keys,
               Py_ssize_t i)
{
    u64map_prefetch(hmap, load_le(hashes + 8 * i, 8));
    u64map_prefetch(res, keys[i]);
}

/* Whether a block needs a rarer rule of the Python path, found before anything changes: its
 * hash is mapped already (extra references) or the engine holds its key already (a duplicate).
 * Taking changes back would not do: a segment grown meanwhile stays grown, and the map's order
 * (snapshots list it) would then differ from the Python path's. 1 yes, 0 no, ERR. */
static int
needs_python(PyObject *res, PyObject *hmap, const engine_bit *b, const unsigned char *hashes,
             const uint64_t *keys, Py_ssize_t n)
{
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        prefetch_block(res, hmap, hashes, keys, i);
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) prefetch_block(res, hmap, hashes, keys, i + AHEAD);
        uint64_t v;
        int where = u64map_find(hmap, load_le(hashes + 8 * i, 8), &v);
        if (where != U64_ABSENT) return where < 0 ? ERR : 1;
        int h = held(res, keys[i], b);
        if (h != 0) return h < 0 ? ERR : 1;
    }
    return 0;
}

typedef struct {
    uint64_t h;    /* engine hash */
    int mapped;    /* h -> key inserted into the hash map */
    mask_change c; /* what happened to key's mask */
} pending_block;

/* Record every block: its engine hash mapped to its key, its mask or'ed with the engine's bit
 * (one probe each: set-if-absent). needs_python has ruled out the rarer cases but one: a hash
 * or key listed twice in the event; that is taken back and STORE_BAIL returned. 0 when done,
 * ERR. The maps end up as Residency.add_many leaves them: each entry inserted in block order. */
static int
insert_blocks(pending_block *pb, PyObject *res, PyObject *hmap, const engine_bit *b,
              const unsigned char *hashes, const uint64_t *keys, Py_ssize_t n)
{
    Py_ssize_t i;
    int code = 0;
    for (i = 0; i < n && code == 0; i++) {
        pending_block *p = &pb[i];
        p->h = load_le(hashes + 8 * i, 8);
        uint64_t old;
        int put = u64map_put_new(hmap, p->h, keys[i], &old);
        if (put < 0) return ERR;
        p->mapped = put == 1;
        int set = p->mapped ? mask_set(res, keys[i], b, &p->c) : 0;
        if (set < 0) return ERR;
        code = set ? 0 : STORE_BAIL;
    }
    if (code == STORE_BAIL) {
        for (Py_ssize_t j = i - 1; j >= 0; j--) { /* last first */
            mask_undo(res, keys[j], &pb[j].c);
            if (pb[j].mapped) (void)u64map_remove(hmap, pb[j].h);
        }
        if (PyErr_Occurred()) return ERR;
    }
    return code;
}

/* The seed of the event's keys: seed_obj, or the key its parent is mapped to. 1, 0 unknown
 * parent, -1 error. */
static int
event_seed(PyObject *hmap, PyObject *parent, PyObject *seed_obj, uint64_t *seed)
{
    PyObject *mapped = NULL;
    if (parent != Py_None) {
        seed_obj = mapped = u64map_get_object(hmap, parent);
        if (seed_obj == NULL) return PyErr_Occurred() ? -1 : 0;
    }
    *seed = PyLong_AsUnsignedLongLongMask(seed_obj);
    Py_XDECREF(mapped);
    return *seed == (uint64_t)-1 && PyErr_Occurred() ? -1 : 1;
}

/* The verdict on the event's blocks: 0 store them, STORE_REANNOUNCED, STORE_BAIL, ERR. */
static int
store_blocks(PyObject *res, PyObject *hmap, const engine_bit *b, PyObject *decided,
             const unsigned char *hashes, const uint64_t *keys, Py_ssize_t n)
{
    int code = 0;
    if (decided != Py_None) {
        code = reannounce(decided, res, b, keys, n);
        if (code == 1) code = STORE_REANNOUNCED;
    }
    if (code == 0) {
        code = needs_python(res, hmap, b, hashes, keys, n);
        if (code == 1) code = STORE_BAIL;
    }
    if (code != 0) return code;
    pending_block *pb = PyMem_Calloc((size_t)n, sizeof(pending_block));
    if (pb == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    code = insert_blocks(pb, res, hmap, b, hashes, keys, n);
    for (Py_ssize_t i = 0; i < n; i++) Py_XDECREF(pb[i].c.obj);
    PyMem_Free(pb);
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
    PyObject *res = args[0], *hmap = args[1], *decided = args[9];
    engine_bit b;
    if (check_map(res, "res") < 0 || check_map(hmap, "hmap") < 0 || bit_open(&b, args[2]) < 0) {
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
    uint64_t seed;
    int known = event_seed(hmap, args[4], args[3], &seed);
    if (known <= 0) {
        return known < 0 ? NULL : PyLong_FromLong(STORE_BAIL); /* unknown parent */
    }
    uint64_t *keys = PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (keys == NULL) return PyErr_NoMemory();
    block_keys(seed, (const unsigned char *)PyBytes_AS_STRING(args[6]), n, unit, bs / unit, keys);
    int code = store_blocks(res, hmap, &b, decided, (const unsigned char *)PyBytes_AS_STRING(args[5]),
                            keys, n);
    PyMem_Free(keys);
    if (code == ERR) return NULL;
    return PyLong_FromSsize_t(code == 0 ? n : code);
}

/* ------------------------------------------------------------------ store_run */

typedef struct {
    Py_ssize_t unit, bs; /* the hash unit; the only group's block size */
    PyObject *group;     /* its index (an int) */
    PyObject *kind, *window; /* its learned facts, kind NULL: none learned at this block size */
    PyObject *model_seed; /* the engine's model namespace root */
} run_facts;

/* Whether record r is a store Ingest._store_packed hands to store_dense with these facts: a
 * dense store of whole units on a GPU, of the only group, its facts unchanged, from a parent
 * or from the model's root (a LoRA's root is Python's to name). */
static int
plain_store(PyObject *r, const run_facts *f)
{
    if (!PyTuple_Check(r) || PyTuple_GET_SIZE(r) < 12) return 0;
    PyObject *type = PyTuple_GET_ITEM(r, 0), *hashes = PyTuple_GET_ITEM(r, 1);
    PyObject *tokens = PyTuple_GET_ITEM(r, 3), *medium = PyTuple_GET_ITEM(r, 6);
    PyObject *g = PyTuple_GET_ITEM(r, 9), *kind = PyTuple_GET_ITEM(r, 10);
    if (!PyLong_Check(type) || PyLong_AsLong(type) != 0 || !PyBytes_Check(hashes) ||
        !PyBytes_Check(tokens) || !PyLong_Check(PyTuple_GET_ITEM(r, 4))) {
        return 0;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(PyTuple_GET_ITEM(r, 4)), n = PyBytes_GET_SIZE(hashes) / 8;
    if (bs == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    if (bs != f->bs || n == 0 || PyBytes_GET_SIZE(tokens) / 4 / bs != n ||
        PyBytes_GET_SIZE(hashes) % 8) {
        return 0;
    }
    if (medium != Py_None && (!PyUnicode_Check(medium) ||
                              PyUnicode_CompareWithASCIIString(medium, "GPU") != 0)) {
        return 0;
    }
    if (g == Py_None) g = NULL; /* group None is group 0 */
    PyObject *zero = g == NULL ? PyLong_FromLong(0) : NULL;
    int same = PyObject_RichCompareBool(g != NULL ? g : zero, f->group, Py_EQ);
    Py_XDECREF(zero);
    if (same != 1) goto no;
    if (kind != Py_None) {
        if (f->kind == NULL || PyObject_RichCompareBool(kind, f->kind, Py_EQ) != 1 ||
            PyObject_RichCompareBool(PyTuple_GET_ITEM(r, 11), f->window, Py_EQ) != 1) {
            goto no;
        }
    }
    return PyTuple_GET_ITEM(r, 2) != Py_None || PyTuple_GET_ITEM(r, 7) == Py_None;
no:
    if (PyErr_Occurred()) PyErr_Clear();
    return 0;
}

/* One plain store (plain_store said so): store_dense's verdict, or the blocks stored. */
static Py_ssize_t
run_one(PyObject *res, PyObject *hmap, const engine_bit *b, PyObject *r, const run_facts *f,
        PyObject *decided)
{
    PyObject *hashes = PyTuple_GET_ITEM(r, 1), *tokens = PyTuple_GET_ITEM(r, 3);
    Py_ssize_t n = PyBytes_GET_SIZE(hashes) / 8;
    uint64_t seed;
    int known = event_seed(hmap, PyTuple_GET_ITEM(r, 2), f->model_seed, &seed);
    if (known <= 0) return known < 0 ? ERR : STORE_BAIL;
    uint64_t *keys = PyMem_Malloc((size_t)n * sizeof(uint64_t));
    if (keys == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    block_keys(seed, (const unsigned char *)PyBytes_AS_STRING(tokens), n, f->unit,
               f->bs / f->unit, keys);
    int code = store_blocks(res, hmap, b, decided, (const unsigned char *)PyBytes_AS_STRING(hashes),
                            keys, n);
    PyMem_Free(keys);
    return code == 0 ? n : code;
}

PyObject *
ingest_store_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "store_run() takes exactly 13 arguments");
        return NULL;
    }
    PyObject *res = args[0], *hmap = args[1], *records = args[3], *resident = args[11];
    PyObject *decided = args[12];
    engine_bit b;
    if (check_map(res, "res") < 0 || check_map(hmap, "hmap") < 0 || bit_open(&b, args[2]) < 0) {
        return NULL;
    }
    if (!PyList_Check(records) || !PyDict_Check(resident) || !PyDict_Check(decided) ||
        !PyLong_Check(args[5]) || !PyLong_Check(args[8])) {
        PyErr_SetString(PyExc_TypeError, "store_run: bad argument types");
        return NULL;
    }
    run_facts f = {.group = args[8], .model_seed = args[5]};
    f.unit = PyLong_AsSsize_t(args[6]);
    f.bs = PyLong_AsSsize_t(args[7]);
    Py_ssize_t i = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (f.unit <= 0 || f.bs <= 0 || f.bs % f.unit || i < 0) {
        PyErr_SetString(PyExc_ValueError, "store_run: not whole units");
        return NULL;
    }
    f.kind = args[9] == Py_None ? NULL : args[9];
    f.window = args[10];
    Py_ssize_t added = 0, reannounced = 0;
    for (; i < PyList_GET_SIZE(records); i++) {
        PyObject *r = PyList_GET_ITEM(records, i);
        if (!plain_store(r, &f)) break;
        /* Ingest._store_packed asks for the re-announce verdict of a store from token 0 while
         * the engine holds blocks (e.resident non-empty, or this run stored some). */
        int judge = PyTuple_GET_ITEM(r, 2) == Py_None &&
                    (PyDict_GET_SIZE(resident) > 0 || added > 0);
        Py_ssize_t code = run_one(res, hmap, &b, r, &f, judge ? decided : Py_None);
        if (code == ERR) return NULL;
        if (code == STORE_BAIL) break;
        if (code == STORE_REANNOUNCED) {
            reannounced++;
        } else {
            added += code;
        }
    }
    return Py_BuildValue("(nnn)", i, added, reannounced);
}
