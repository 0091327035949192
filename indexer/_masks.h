/* The engine-mask helpers of indexer/_residency.c (stores) and indexer/_removal.c (removals):
 * a residency table (content key -> mask of the engines holding the block) is a U64Map whose
 * uint64 masks are read and written without a Python object; a mask in a side dict (an engine
 * past slot 63) goes through Python ints. Static inline: each file compiles what it uses. */
#ifndef KVROUTER_MASKS_H
#define KVROUTER_MASKS_H

#include <Python.h>

#include <stdint.h>

#include "_u64map.h"

/* Blocks whose places are asked of the cache ahead of their lookups (u64map_prefetch). */
#define AHEAD 8

static inline int
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

static inline int
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
static inline int
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
static inline PyObject *
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

/* ------------------------------------------------------------------ masks in a U64Map */

/* Whether the engine holds key k in res: 1, 0, or -1 with an error. */
static inline int
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
static inline int
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
static inline int
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
static inline void
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
static inline int
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

#endif
