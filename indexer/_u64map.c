/*
 * U64Map: the index's big maps (content key -> engine mask, engine hash -> content key) as
 * uint64 -> uint64 open addressing, part of indexer._native. indexer/u64map.py has the
 * pure-Python reference (PyU64Map) and says why the map is split in segments.
 *
 * Layout: SEGMENTS segments; key k belongs to segment SLOT_SEG[k & 1023] (any other key:
 * hash(key) & 1023), the slot shares of u64map.py, so segments reach their growth points at
 * different moments. A segment is one PyMem block of cap (key, value) places, linear probing
 * from murmur3's fmix64(k), key 0 meaning empty; deletion shifts the following entries back,
 * so churn leaves no tombstones and probe runs stay as short as the load allows. A segment
 * doubles when it passes 3/4 full: that growth re-inserts only that segment's entries, at most
 * 87/1024 of the map's (the largest share) give or take the chance deviation of its fill.
 *
 * Entries that are not (uint64 key != 0, uint64 value) -- bytes hashes, negative ints, key 0,
 * masks of engines past slot 63 -- live in the segment's side dict, so the map is a dict for
 * every key and value; side_ints counts the side keys a uint64 lookup must also look for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_u64map_impl.h"

/* ------------------------------------------------------------------ native part */

/* The place of k in s, or of the empty place ending its probe run (-1 when cap is 0). */
static inline Py_ssize_t
probe(const segment *s, uint64_t k)
{
    if (s->cap == 0) {
        return -1;
    }
    size_t mask = (size_t)s->cap - 1, i = (size_t)fmix64(k) & mask;
    while (s->e[i].k != 0 && s->e[i].k != k) {
        i = (i + 1) & mask;
    }
    return (Py_ssize_t)i;
}

static int
grow(segment *s)
{
    Py_ssize_t cap = s->cap ? s->cap * 2 : MIN_CAP;
    if ((size_t)cap > PY_SSIZE_T_MAX / 16) {
        PyErr_NoMemory();
        return -1;
    }
    entry *e = PyMem_Calloc((size_t)cap, sizeof(entry));
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < s->cap; j++) {
        if (s->e[j].k != 0) {
            size_t i = (size_t)fmix64(s->e[j].k) & mask;
            while (e[i].k != 0) {
                i = (i + 1) & mask;
            }
            e[i] = s->e[j];
        }
    }
    PyMem_Free(s->e);
    s->e = e;
    s->cap = cap;
    return 0;
}

/* Insert or update: 1 inserted, 0 updated (*old set if old), -1 no memory. */
static int
native_set(segment *s, uint64_t k, uint64_t v, uint64_t *old, int keep)
{
    Py_ssize_t i = probe(s, k);
    if (i >= 0 && s->e[i].k == k) {
        if (old != NULL) *old = s->e[i].v;
        if (!keep) s->e[i].v = v;
        return 0;
    }
    if (s->used + 1 > s->cap - s->cap / 4) {
        if (grow(s) < 0) return -1;
        i = probe(s, k);
    }
    s->e[i].k = k;
    s->e[i].v = v;
    s->used++;
    return 1;
}

/* Empty place i, shifting back the entries of its probe run that may move (no tombstones). */
static void
native_erase(segment *s, size_t i)
{
    size_t mask = (size_t)s->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (s->e[j].k == 0) break;
        size_t home = (size_t)fmix64(s->e[j].k) & mask;
        /* The entry at j stays unless its home lies cyclically outside (i, j]. */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            s->e[i] = s->e[j];
            i = j;
        }
    }
    s->e[i].k = 0;
    s->used--;
}

/* ------------------------------------------------------------------ keys and values */

/* 1 when value is an exact int in [0, 2**64) (*v set): bool and int subclasses keep their type
 * in a side dict. */
static inline int
value_u64(PyObject *value, uint64_t *v)
{
    if (!PyLong_CheckExact(value)) return 0;
    *v = PyLong_AsUnsignedLongLong(value);
    if (*v == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

segment *
u64map_segment(U64MapObject *m, PyObject *key)
{
    if (PyLong_Check(key)) {
        return seg_of(m, PyLong_AsUnsignedLongLongMask(key));
    }
    Py_hash_t h = PyObject_Hash(key);
    if (h == -1 && PyErr_Occurred()) return NULL;
    return seg_of(m, (uint64_t)h);
}

/* Set key in s's side dict: 1 new, 0 replaced, -1 error. */
static int
side_set(segment *s, PyObject *key, PyObject *value)
{
    if (s->side == NULL && (s->side = PyDict_New()) == NULL) return -1;
    Py_ssize_t before = PyDict_GET_SIZE(s->side);
    if (PyDict_SetItem(s->side, key, value) < 0) return -1;
    return PyDict_GET_SIZE(s->side) != before;
}

/* Delete key from s's side dict: 1 deleted, 0 absent, -1 error. */
static int
side_del(segment *s, PyObject *key)
{
    if (s->side == NULL || PyDict_GET_SIZE(s->side) == 0) return 0;
    int has = PyDict_Contains(s->side, key);
    if (has <= 0) return has;
    return PyDict_DelItem(s->side, key) < 0 ? -1 : 1;
}

/* ------------------------------------------------------------------ C API */

static PyObject *
side_lookup_u64(segment *s, uint64_t k)
{
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    if (key == NULL) return NULL;
    PyObject *v = PyDict_GetItemWithError(s->side, key);
    Py_DECREF(key);
    return v; /* borrowed */
}

/* Whether k (not found natively) may be in s's side dict. */
static inline int
maybe_side(const segment *s, uint64_t k)
{
    return s->side != NULL && (k == 0 ? PyDict_GET_SIZE(s->side) != 0 : s->side_ints != 0);
}

int
u64map_find(PyObject *o, uint64_t k, uint64_t *v)
{
    segment *s = seg_of(MAP(o), k);
    if (k != 0) {
        Py_ssize_t i = probe(s, k);
        if (i >= 0 && s->e[i].k == k) {
            *v = s->e[i].v;
            return U64_NATIVE;
        }
    }
    if (!maybe_side(s, k)) return U64_ABSENT;
    PyObject *got = side_lookup_u64(s, k);
    if (got == NULL) return PyErr_Occurred() ? -1 : U64_ABSENT;
    return U64_SIDE;
}

void
u64map_prefetch(PyObject *o, uint64_t k)
{
    const segment *s = seg_of(MAP(o), k);
    if (s->cap != 0) {
#if defined(__GNUC__) || defined(__clang__)
        __builtin_prefetch(&s->e[(size_t)fmix64(k) & ((size_t)s->cap - 1)]);
#endif
    }
}

int
u64map_put_new(PyObject *o, uint64_t k, uint64_t v, uint64_t *old)
{
    U64MapObject *m = MAP(o);
    segment *s = seg_of(m, k);
    if (k == 0 || maybe_side(s, k)) {
        int where = u64map_find(o, k, old);
        if (where != U64_ABSENT) return where == U64_NATIVE ? 0 : where;
        if (k == 0) {
            PyObject *key = PyLong_FromUnsignedLongLong(k), *val = PyLong_FromUnsignedLongLong(v);
            int rc = key && val ? u64map_set_object(o, key, val) : -1;
            Py_XDECREF(key);
            Py_XDECREF(val);
            return rc < 0 ? -1 : 1;
        }
    }
    int rc = native_set(s, k, v, old, 1);
    if (rc == 1) {
        m->len++;
        m->version++;
    }
    return rc;
}

int
u64map_put(PyObject *o, uint64_t k, uint64_t v)
{
    U64MapObject *m = MAP(o);
    segment *s = seg_of(m, k);
    if (k == 0 || maybe_side(s, k)) {
        PyObject *key = PyLong_FromUnsignedLongLong(k), *val = PyLong_FromUnsignedLongLong(v);
        int rc = key && val ? u64map_set_object(o, key, val) : -1;
        Py_XDECREF(key);
        Py_XDECREF(val);
        return rc;
    }
    int rc = native_set(s, k, v, NULL, 0);
    if (rc == 1) {
        m->len++;
        m->version++;
    }
    return rc < 0 ? -1 : 0;
}

int
u64map_remove(PyObject *o, uint64_t k)
{
    U64MapObject *m = MAP(o);
    segment *s = seg_of(m, k);
    if (k != 0) {
        Py_ssize_t i = probe(s, k);
        if (i >= 0 && s->e[i].k == k) {
            native_erase(s, (size_t)i);
            m->len--;
            m->version++;
            return 1;
        }
    }
    if (!maybe_side(s, k)) return 0;
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    if (key == NULL) return -1;
    int rc = u64map_del_object(o, key);
    Py_DECREF(key);
    return rc;
}

PyObject *
u64map_get_object(PyObject *o, PyObject *key)
{
    U64MapObject *m = MAP(o);
    segment *s = u64map_segment(m, key);
    if (s == NULL) return NULL;
    uint64_t k;
    if (key_u64(key, &k)) {
        Py_ssize_t i = probe(s, k);
        if (i >= 0 && s->e[i].k == k) return PyLong_FromUnsignedLongLong(s->e[i].v);
        if (s->side_ints == 0) return NULL;
    }
    if (s->side == NULL) return NULL;
    return Py_XNewRef(PyDict_GetItemWithError(s->side, key));
}

int
u64map_set_object(PyObject *o, PyObject *key, PyObject *value)
{
    U64MapObject *m = MAP(o);
    segment *s = u64map_segment(m, key);
    if (s == NULL) return -1;
    uint64_t k, v;
    int native_key = key_u64(key, &k), rc;
    if (native_key && value_u64(value, &v)) {
        if (s->side_ints && (rc = side_del(s, key)) != 0) { /* moves to the native part */
            if (rc < 0) return -1;
            s->side_ints--, m->len--, m->version++;
        }
        rc = native_set(s, k, v, NULL, 0);
    } else {
        if (native_key) {
            Py_ssize_t i = probe(s, k);
            if (i >= 0 && s->e[i].k == k) { /* moves to the side dict */
                native_erase(s, (size_t)i);
                m->len--, m->version++;
            }
        }
        rc = side_set(s, key, value);
        if (rc == 1 && native_key) s->side_ints++;
    }
    if (rc == 1) m->len++, m->version++;
    return rc < 0 ? -1 : 0;
}

int
u64map_del_object(PyObject *o, PyObject *key)
{
    U64MapObject *m = MAP(o);
    segment *s = u64map_segment(m, key);
    if (s == NULL) return -1;
    uint64_t k;
    int native_key = key_u64(key, &k);
    if (native_key) {
        Py_ssize_t i = probe(s, k);
        if (i >= 0 && s->e[i].k == k) {
            native_erase(s, (size_t)i);
            m->len--, m->version++;
            return 1;
        }
        if (s->side_ints == 0) return 0;
    }
    int rc = side_del(s, key);
    if (rc == 1) {
        m->len--, m->version++;
        if (native_key) s->side_ints--;
    }
    return rc;
}

void
u64map_clear_all(U64MapObject *m)
{
    for (int i = 0; i < SEGMENTS; i++) {
        segment *s = &m->seg[i];
        PyMem_Free(s->e);
        s->e = NULL;
        s->cap = s->used = s->side_ints = 0;
        Py_CLEAR(s->side);
    }
    m->len = 0;
    m->version++;
}
