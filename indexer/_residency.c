/*
 * Residency in C, part of indexer._native (indexer/residency.py is the reference and decides
 * when these apply):
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
 *   remove_hashes(res, hmap, bit, hashes, dups, extra_refs, dup_prefix, sink)
 *       -> (removed, unknown, cleared)   (Residency.remove over packed hashes)
 *
 * res (content key -> engine mask) and hmap (engine hash -> content key) are U64Maps
 * (indexer/u64map.py): their uint64 entries go through its C API, with no Python object per
 * block; a mask in a side dict (an engine past slot 63) goes through Python ints.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

#include "_ingest.h"
#include "_u64map.h"

#define STORE_BAIL (-1)
#define STORE_REANNOUNCED (-2)
#define ERR (-3)

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

/* ------------------------------------------------------------------ masks in a U64Map */

/* Whether the engine holds key k in res: 1, 0, or -1 with an error. */
static int
held(PyObject *res, uint64_t k, const engine_bit *b)
{
    uint64_t m;
    int where = u64map_find(res, k, &m);
    if (where != U64_SIDE) {
        return where == U64_NATIVE ? b->fits && (m & b->u) != 0 : where;
    }
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    PyObject *v = key == NULL ? NULL : u64map_get_object(res, key);
    Py_XDECREF(key);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    int rc = mask_has(v, b);
    Py_DECREF(v);
    return rc;
}

enum { RES_UNTOUCHED, RES_INSERTED, RES_UPDATED };

typedef struct {
    int state;     /* what mask_set did */
    uint64_t old;  /* the mask before (RES_UPDATED), */
    PyObject *obj; /* or it as an int when it was in a side dict (owned) */
} mask_change;

/* res[k] |= bit through Python ints: for a mask in a side dict, or a bit past 64. */
static int
mask_set_object(PyObject *res, uint64_t k, const engine_bit *b, mask_change *c)
{
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    if (key == NULL) return -1;
    int rc = -1;
    PyObject *m = u64map_get_object(res, key), *nm = NULL;
    if (m == NULL && PyErr_Occurred()) goto out;
    if (m != NULL && (rc = mask_has(m, b)) != 0) {
        rc = rc < 0 ? -1 : 0;
        goto out;
    }
    rc = -1;
    nm = mask_with(m, b, 0);
    if (nm == NULL || u64map_set_object(res, key, nm) < 0) goto out;
    c->state = m == NULL ? RES_INSERTED : RES_UPDATED;
    c->obj = m;
    m = NULL;
    rc = 1;
out:
    Py_XDECREF(nm);
    Py_XDECREF(m);
    Py_DECREF(key);
    return rc;
}

/* res[k] |= bit: 1 done (*c says what was there), 0 the engine holds k already, -1 error. */
static int
mask_set(PyObject *res, uint64_t k, const engine_bit *b, mask_change *c)
{
    if (!b->fits) return mask_set_object(res, k, b, c);
    uint64_t old;
    int put = u64map_put_new(res, k, b->u, &old);
    if (put == 1) {
        c->state = RES_INSERTED;
        return 1;
    }
    if (put != 0) return put < 0 ? -1 : mask_set_object(res, k, b, c); /* U64_SIDE */
    if (old & b->u) return 0;
    if (u64map_put(res, k, old | b->u) < 0) return -1; /* present: never allocates */
    c->state = RES_UPDATED;
    c->old = old;
    return 1;
}

/* Take back what mask_set did to res[k]. */
static void
mask_undo(PyObject *res, uint64_t k, const mask_change *c)
{
    if (c->state == RES_INSERTED) {
        (void)u64map_remove(res, k);
    } else if (c->state == RES_UPDATED && c->obj == NULL) {
        (void)u64map_put(res, k, c->old);
    } else if (c->state == RES_UPDATED) {
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key != NULL) (void)u64map_set_object(res, key, c->obj);
        Py_XDECREF(key);
    }
}

/* res[k] &= ~bit, the entry deleted when no engine is left (the engine holds k). 0, -1. */
static int
mask_clear(PyObject *res, uint64_t k, const engine_bit *b)
{
    uint64_t m;
    int where = u64map_find(res, k, &m);
    if (where == U64_NATIVE && b->fits) {
        m &= ~b->u;
        return m ? u64map_put(res, k, m) : (u64map_remove(res, k) < 0 ? -1 : 0);
    }
    if (where < 0) return -1;
    PyObject *key = PyLong_FromUnsignedLongLong(k), *nm = NULL;
    PyObject *v = key == NULL ? NULL : u64map_get_object(res, key);
    int rc = -1, truth;
    if (v != NULL && (nm = mask_with(v, b, 1)) != NULL && (truth = PyObject_IsTrue(nm)) >= 0) {
        rc = truth ? u64map_set_object(res, key, nm) : (u64map_del_object(res, key) < 0 ? -1 : 0);
    }
    Py_XDECREF(nm);
    Py_XDECREF(v);
    Py_XDECREF(key);
    return rc;
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

/* Blocks whose places are asked of the cache ahead of their lookups (u64map_prefetch). */
#define AHEAD 8

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

/* ------------------------------------------------------------------ remove_hashes */

/* The content key engine hash hu is mapped to, when it is in a side dict (hash 0). 0, -1. */
static int
side_key(PyObject *hmap, uint64_t hu, uint64_t *key)
{
    PyObject *h = PyLong_FromUnsignedLongLong(hu);
    PyObject *v = h == NULL ? NULL : u64map_get_object(hmap, h);
    Py_XDECREF(h);
    if (v == NULL) return -1; /* present: a NULL is an error */
    *key = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return *key == (uint64_t)-1 && PyErr_Occurred() ? -1 : 0;
}

/* A duplicate copy of key goes first, if the engine holds one: 1 it did, 0 none, -1 error. */
static int
dup_release(PyObject *dups, PyObject *prefix, uint64_t key)
{
    if (PyDict_GET_SIZE(dups) == 0) return 0;
    PyObject *k = PyLong_FromUnsignedLongLong(key);
    PyObject *dk = k == NULL ? NULL
                             : PyTuple_Pack(4, PyTuple_GET_ITEM(prefix, 0),
                                            PyTuple_GET_ITEM(prefix, 1),
                                            PyTuple_GET_ITEM(prefix, 2), k);
    Py_XDECREF(k);
    if (dk == NULL) return -1;
    int rc = -1;
    PyObject *extra = PyDict_GetItemWithError(dups, dk), *lo = NULL;
    int has = extra == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_IsTrue(extra);
    if (has <= 0) {
        rc = has;
    } else {
        long left = PyLong_AsLong(extra) - 1;
        if (!PyErr_Occurred()) {
            lo = left ? PyLong_FromLong(left) : NULL;
            int st = left ? (lo == NULL ? -1 : PyDict_SetItem(dups, dk, lo))
                          : PyDict_DelItem(dups, dk);
            rc = st < 0 ? -1 : 1;
        }
    }
    Py_XDECREF(lo);
    Py_DECREF(dk);
    return rc;
}

/* One reference to engine hash hu goes: an extra one if any, else its mapping. 1, -1. */
static int
unref_hash(PyObject *hmap, uint64_t hu, PyObject *extra_refs)
{
    if (PyDict_GET_SIZE(extra_refs) == 0) {
        return u64map_remove(hmap, hu) < 0 ? -1 : 1;
    }
    PyObject *h = PyLong_FromUnsignedLongLong(hu);
    if (h == NULL) return -1;
    int rc = -1;
    PyObject *refs = PyDict_GetItemWithError(extra_refs, h), *ro = NULL;
    if (refs == NULL) {
        rc = PyErr_Occurred() || u64map_remove(hmap, hu) < 0 ? -1 : 1;
    } else {
        long r = PyLong_AsLong(refs);
        if (!(r == -1 && PyErr_Occurred())) {
            ro = r == 1 ? NULL : PyLong_FromLong(r - 1);
            int st = r == 1 ? PyDict_DelItem(extra_refs, h)
                            : ro == NULL ? -1 : PyDict_SetItem(extra_refs, h, ro);
            rc = st < 0 ? -1 : 1;
        }
    }
    Py_XDECREF(ro);
    Py_DECREF(h);
    return rc;
}

/* One engine hash of a removal; returns 1 removed, 0 unknown, -1 error; *cleared += 1 when
 * the engine's residency entry went (not just a duplicate copy). */
static int
remove_one(PyObject *res, PyObject *hmap, const engine_bit *b, uint64_t hu, PyObject *dups,
           PyObject *extra_refs, PyObject *prefix, int *cleared)
{
    uint64_t key;
    int where = u64map_find(hmap, hu, &key);
    if (where < 0 || (where == U64_SIDE && side_key(hmap, hu, &key) < 0)) return -1;
    if (where == U64_ABSENT || res == Py_None) return 0;
    int h = held(res, key, b);
    if (h <= 0) return h;
    int dup = dup_release(dups, prefix, key);
    if (dup < 0) return -1;
    if (!dup) {
        if (mask_clear(res, key, b) < 0) return -1;
        *cleared += 1;
    }
    return unref_hash(hmap, hu, extra_refs);
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
    if ((res != Py_None && check_map(res, "res") < 0) || check_map(hmap, "hmap") < 0 ||
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
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) {
        u64map_prefetch(hmap, load_le(hp + 8 * i, 8));
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) u64map_prefetch(hmap, load_le(hp + 8 * (i + AHEAD), 8));
        if (i + AHEAD / 2 < n && res != Py_None) { /* its key is in the cache by now */
            uint64_t key;
            int where = u64map_find(hmap, load_le(hp + 8 * (i + AHEAD / 2), 8), &key);
            if (where == U64_NATIVE) u64map_prefetch(res, key);
            if (where < 0) PyErr_Clear(); /* a hint only: the removal meets it again */
        }
        uint64_t hu = load_le(hp + 8 * i, 8);
        int rc = remove_one(res, hmap, &b, hu, dups, extra_refs, prefix, &cleared);
        if (rc == 0) {
            unknown++;
            PyObject *h = sink == Py_None ? NULL : PyLong_FromUnsignedLongLong(hu);
            if (sink != Py_None && (h == NULL || PySet_Add(sink, h) < 0)) rc = -1;
            Py_XDECREF(h);
        }
        if (rc < 0) return NULL;
        removed += rc;
    }
    return Py_BuildValue("(nni)", removed, unknown, cleared);
}
