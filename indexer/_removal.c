/*
 * Removals in C, part of indexer._native (indexer/residency.py is the reference and decides
 * when this applies):
 *
 *   remove_hashes(res, hmap, bit, hashes, dups, extra_refs, dup_prefix, sink)
 *       -> (removed, unknown, cleared)   (Residency.remove over packed hashes)
 *
 * res (content key -> engine mask) and hmap (engine hash -> content key) are U64Maps; the
 * mask helpers are shared with the stores (indexer/_masks.h).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_ingest.h"
#include "_masks.h"
#include "_u64map.h"

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
