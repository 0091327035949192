/*
 * run_scan, part of indexer._native: the block loop of indexer.hit_rules.full_attention_run over
 * a residency table (a U64Map). indexer/native.py has the Python version and the contract.
 * Keys are looked up as uint64 without an object; the places of the next SCAN_AHEAD blocks are
 * asked of the cache first, so the misses of a long prompt over a large index overlap.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_buffers.h"
#include "_scan.h"
#include "_u64map.h"

/* keys as run_scan reads them: a 1-D buffer of native uint64 (array('Q'), a 'Q' memoryview),
 * else any sequence through PySequence_Fast (a list or tuple is used in place). */
typedef struct {
    Py_buffer view;
    int has_view;
    PyObject *seq; /* a new reference when !has_view */
} scan_keys;

static int
scan_keys_open(scan_keys *k, PyObject *obj)
{
    k->has_view = 0;
    k->seq = NULL;
    if (PyObject_CheckBuffer(obj)) {
        if (PyObject_GetBuffer(obj, &k->view, PyBUF_FORMAT | PyBUF_STRIDES) < 0) {
            return -1;
        }
        if (is_u64_vector(&k->view)) {
            k->has_view = 1; /* the exporter cannot resize while the view is held */
            return 0;
        }
        PyBuffer_Release(&k->view); /* any other buffer (bytes, array('I')): its items */
    }
    k->seq = PySequence_Fast(obj, "run_scan: keys must be a sequence or a uint64 buffer");
    return k->seq == NULL ? -1 : 0;
}

static void
scan_keys_close(scan_keys *k)
{
    if (k->has_view) {
        PyBuffer_Release(&k->view);
    }
    Py_XDECREF(k->seq);
}

/* The number of keys now: a list can change size while Python code runs in a dict lookup. */
static inline Py_ssize_t
scan_keys_len(const scan_keys *k)
{
    return k->has_view ? k->view.shape[0] : PySequence_Fast_GET_SIZE(k->seq);
}

/* Key i (0 <= i < scan_keys_len): 1 with *u set when it is an int in [1, 2**64) (the map's
 * uint64 lookup), else 0 with a new reference to it as an int in *obj; -1 with an error. */
static inline int
scan_key(const scan_keys *k, Py_ssize_t i, uint64_t *u, PyObject **obj)
{
    if (k->has_view) {
        memcpy(u, (const char *)k->view.buf + i * k->view.strides[0], sizeof *u);
        if (*u != 0) return 1;
        *obj = PyLong_FromUnsignedLongLong(0);
        return *obj == NULL ? -1 : 0;
    }
    PyObject *item = PySequence_Fast_GET_ITEM(k->seq, i);
    if (PyLong_CheckExact(item)) {
        *u = PyLong_AsUnsignedLongLong(item);
        if (!(*u == (uint64_t)-1 && PyErr_Occurred()) && *u != 0) return 1;
        PyErr_Clear(); /* negative, or beyond 64 bits */
    }
    /* Anything but an int through __index__ (TypeError for a str or a float, as the Python
     * version's operator.index). */
    *obj = PyLong_Check(item) ? Py_NewRef(item) : PyNumber_Index(item);
    return *obj == NULL ? -1 : 0;
}

/* Blocks whose places run_scan asks the cache for before it looks them up. */
#define SCAN_AHEAD 8

/* Ask the cache for block b's place in map, if b is scanned and its key an int (a hint only). */
static inline void
scan_prefetch(const scan_keys *k, PyObject *map, Py_ssize_t b, Py_ssize_t step, Py_ssize_t count)
{
    if (b >= count || b + 1 > scan_keys_len(k) / step) return;
    Py_ssize_t i = (b + 1) * step - 1;
    uint64_t u;
    if (k->has_view) {
        memcpy(&u, (const char *)k->view.buf + i * k->view.strides[0], sizeof u);
    } else {
        PyObject *item = PySequence_Fast_GET_ITEM(k->seq, i);
        if (!PyLong_CheckExact(item)) return;
        u = PyLong_AsUnsignedLongLongMask(item); /* never fails for an int */
    }
    u64map_prefetch(map, u);
}

/* The value of a block's key in map: 1 with *v (0 when absent) for a uint64 value, else 0 with
 * a new reference in *val; -1 with an error. `fast`: the key is the uint64 u, else obj. */
static int
scan_value(PyObject *map, int fast, uint64_t u, PyObject *obj, uint64_t *v, PyObject **val)
{
    PyObject *key = NULL;
    if (fast) {
        int where = u64map_find(map, u, v);
        if (where < 0) return -1;
        if (where == U64_NATIVE) return 1;
        if (where == U64_ABSENT) {
            *v = 0;
            return 1;
        }
        obj = key = PyLong_FromUnsignedLongLong(u); /* in a side dict */
        if (key == NULL) return -1;
    }
    *val = u64map_get_object(map, obj);
    Py_XDECREF(key);
    if (*val != NULL) return 0;
    if (PyErr_Occurred()) return -1;
    *v = 0;
    return 1;
}

/* (b, now), stealing now (NULL: an error is set, passed on). */
static PyObject *
scan_result(Py_ssize_t b, PyObject *now)
{
    if (now == NULL) {
        return NULL;
    }
    PyObject *bo = PyLong_FromSsize_t(b);
    if (bo == NULL) {
        Py_DECREF(now);
        return NULL;
    }
    PyObject *out = PyTuple_Pack(2, bo, now);
    Py_DECREF(bo);
    Py_DECREF(now);
    return out;
}

/* The block loop of run_scan over open keys; alive_fits: alive (alive_obj) fits 64 bits. */
static PyObject *
scan_blocks(PyObject *tables, const scan_keys *k, PyObject *alive_obj, uint64_t alive,
            int alive_fits, Py_ssize_t first, Py_ssize_t step, Py_ssize_t count)
{
    PyObject *out = NULL;
    for (Py_ssize_t b = first; b < first + SCAN_AHEAD && b < count; b++) {
        scan_prefetch(k, tables, b, step, count);
    }
    for (Py_ssize_t b = first; b < count; b++) {
        if (b <= PY_SSIZE_T_MAX - SCAN_AHEAD) {
            scan_prefetch(k, tables, b + SCAN_AHEAD, step, count);
        }
        /* Block b's key is keys[(b + 1) * step - 1], in range iff b + 1 <= len // step (no
         * overflow: b < count <= PY_SSIZE_T_MAX and step >= 1). */
        if (b + 1 > scan_keys_len(k) / step) {
            PyErr_SetString(PyExc_IndexError, "run_scan: key index out of range");
            goto done;
        }
        uint64_t u, v;
        PyObject *key = NULL, *val = NULL;
        int fast = scan_key(k, (b + 1) * step - 1, &u, &key);
        int plain = fast < 0 ? -1 : scan_value(tables, fast, u, key, &v, &val);
        Py_XDECREF(key);
        if (plain < 0) {
            goto done;
        }
        if (plain && alive_fits) {
            const unsigned long long now = alive & v;
            if (now != alive) {
                out = scan_result(b, PyLong_FromUnsignedLongLong(now));
                goto done;
            }
            continue;
        }
        /* General case, exactly Python's `now = alive & v; if now != alive` (TypeError for a
         * value that is not an int). */
        if (plain && (val = PyLong_FromUnsignedLongLong(v)) == NULL) {
            goto done;
        }
        PyObject *now = PyNumber_And(alive_obj, val);
        Py_DECREF(val);
        if (now == NULL) {
            goto done;
        }
        const int ne = PyObject_RichCompareBool(now, alive_obj, Py_NE);
        if (ne > 0) {
            out = scan_result(b, now);
            goto done;
        }
        Py_DECREF(now);
        if (ne < 0) {
            goto done;
        }
    }
    out = scan_result(count, Py_NewRef(alive_obj));
done:
    return out;
}

PyObject *
native_run_scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError,
                     "run_scan() takes exactly 6 arguments "
                     "(tables, keys, first, step, count, alive), %zd given",
                     nargs);
        return NULL;
    }
    PyObject *tables = args[0], *keys_obj = args[1], *alive_obj = args[5];
    /* Integers beyond Py_ssize_t are clamped to its range (the fallback clamps the same). */
    const Py_ssize_t first = PyNumber_AsSsize_t(args[2], NULL);
    if (first == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const Py_ssize_t step = PyNumber_AsSsize_t(args[3], NULL);
    if (step == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const Py_ssize_t count = PyNumber_AsSsize_t(args[4], NULL);
    if (count == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!U64Map_Check(tables)) {
        PyErr_Format(PyExc_TypeError, "run_scan: tables must be a U64Map, not %.100s",
                     Py_TYPE(tables)->tp_name);
        return NULL;
    }
    if (!PyLong_Check(alive_obj)) {
        PyErr_Format(PyExc_TypeError, "run_scan: alive must be an int, not %.100s",
                     Py_TYPE(alive_obj)->tp_name);
        return NULL;
    }
    if (first < 0 || step < 1) {
        PyErr_SetString(PyExc_ValueError, "run_scan: first must be >= 0 and step >= 1");
        return NULL;
    }
    if (first >= count) {
        return scan_result(count, Py_NewRef(alive_obj));
    }
    /* Fast path: alive fits in 64 bits (up to 64 engines). alive & v then depends only on the
     * low 64 bits of v, whatever v's size or sign. Otherwise, Python ints block by block. */
    int alive_fits = 1;
    const unsigned long long alive = PyLong_AsUnsignedLongLong(alive_obj);
    if (alive == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear(); /* negative, or beyond 64 bits */
        alive_fits = 0;
    }

    scan_keys k;
    if (scan_keys_open(&k, keys_obj) < 0) {
        return NULL;
    }
    PyObject *out = scan_blocks(tables, &k, alive_obj, alive, alive_fits, first, step, count);
    scan_keys_close(&k);
    return out;
}

