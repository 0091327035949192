/*
 * The Python face of U64Map (indexer/_u64map.c): the dict methods the index uses, iterators
 * over keys / values / items (RuntimeError once the map changed size, as a dict's), and the
 * segment methods of indexer/u64map.py's reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_u64map_impl.h"

/* ------------------------------------------------------------------ iteration */

enum { IT_KEYS, IT_VALUES, IT_ITEMS };

typedef struct {
    PyObject_HEAD
    U64MapObject *map;
    uint64_t version;
    int kind, seg, part;   /* segment, and its part: 0 table, 1 previous table, 2 side dict */
    Py_ssize_t pos;        /* place in the table, or PyDict_Next's position */
    Py_ssize_t only;        /* one segment (segment_keys), or -1: all */
} U64IterObject;

static PyTypeObject U64Iter_Type;

static PyObject *
make_iter(U64MapObject *m, int kind, Py_ssize_t only)
{
    U64IterObject *it = PyObject_New(U64IterObject, &U64Iter_Type);
    if (it == NULL) return NULL;
    it->map = (U64MapObject *)Py_NewRef(m);
    it->version = m->version;
    it->kind = kind;
    it->seg = only < 0 ? 0 : (int)only;
    it->part = 0;
    it->pos = 0;
    it->only = only;
    return (PyObject *)it;
}

static void
iter_dealloc(U64IterObject *it)
{
    Py_XDECREF(it->map);
    PyObject_Free(it);
}

static PyObject *
iter_entry(int kind, PyObject *k, PyObject *v) /* steals k and v */
{
    if (k == NULL || v == NULL || kind != IT_ITEMS) {
        Py_XDECREF(kind == IT_VALUES ? k : v);
        return kind == IT_VALUES ? v : k;
    }
    PyObject *t = PyTuple_Pack(2, k, v);
    Py_DECREF(k);
    Py_DECREF(v);
    return t;
}

/* The next entry of segment s from the iterator's position, or NULL at its end. */
static PyObject *
seg_next(U64IterObject *it, segment *s)
{
    for (; it->part < 2; it->part++, it->pos = 0) {
        if (it->part == 0 && s->written != NULL) u64map_settle(s); /* pages never entered */
        const entry *e = it->part == 0 ? s->e : s->old;
        Py_ssize_t cap = it->part == 0 ? s->cap : s->old_cap;
        for (; it->pos < cap; it->pos++) {
            if (e[it->pos].k != 0) {
                const entry *p = &e[it->pos++];
                PyObject *k = it->kind == IT_VALUES ? Py_NewRef(Py_None)
                                                    : PyLong_FromUnsignedLongLong(p->k);
                PyObject *v = it->kind == IT_KEYS ? Py_NewRef(Py_None)
                                                  : PyLong_FromUnsignedLongLong(p->v);
                return iter_entry(it->kind, k, v);
            }
        }
    }
    PyObject *k, *v;
    if (s->side != NULL && PyDict_Next(s->side, &it->pos, &k, &v)) {
        return iter_entry(it->kind, Py_NewRef(k), Py_NewRef(v));
    }
    return NULL;
}

static PyObject *
iter_next(U64IterObject *it)
{
    U64MapObject *m = it->map;
    if (m == NULL) return NULL;
    if (m->version != it->version) {
        PyErr_SetString(PyExc_RuntimeError, "U64Map changed size during iteration");
        return NULL;
    }
    while (it->seg < SEGMENTS) {
        PyObject *out = seg_next(it, &m->seg[it->seg]);
        if (out != NULL || PyErr_Occurred()) return out;
        if (it->only >= 0) break;
        it->seg++, it->part = 0, it->pos = 0;
    }
    Py_CLEAR(it->map);
    return NULL;
}

static PyTypeObject U64Iter_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native.U64MapIterator",
    .tp_basicsize = sizeof(U64IterObject),
    .tp_dealloc = (destructor)iter_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)iter_next,
};

/* ------------------------------------------------------------------ Python methods */

static PyObject *
map_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args, (void)kwds;
    return type->tp_alloc(type, 0); /* zeroed: every segment empty */
}

static int
map_init(PyObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *items = NULL;
    static char *kwlist[] = {"items", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:U64Map", kwlist, &items)) return -1;
    u64map_clear_all(MAP(self));
    if (items == NULL) return 0;
    PyObject *iter = PyObject_GetIter(items), *pair;
    if (iter == NULL) return -1;
    while ((pair = PyIter_Next(iter)) != NULL) {
        PyObject *k, *v;
        int rc = PyArg_ParseTuple(pair, "OO:U64Map item", &k, &v) ? u64map_set_object(self, k, v)
                                                                   : -1;
        Py_DECREF(pair);
        if (rc < 0) break;
    }
    Py_DECREF(iter);
    return PyErr_Occurred() ? -1 : 0;
}

static void
map_dealloc(PyObject *self)
{
    u64map_clear_all(MAP(self));
    Py_TYPE(self)->tp_free(self);
}

static void
key_error(PyObject *key)
{
    PyObject *t = PyTuple_Pack(1, key);
    if (t != NULL) {
        PyErr_SetObject(PyExc_KeyError, t);
        Py_DECREF(t);
    }
}

/* One or two positional arguments. */
static int
positional(const char *name, Py_ssize_t nargs)
{
    if (nargs == 1 || nargs == 2) return 1;
    PyErr_Format(PyExc_TypeError, "%s expected 1 or 2 arguments, got %zd", name, nargs);
    return 0;
}

static Py_ssize_t
map_len(PyObject *self)
{
    return MAP(self)->len;
}

static PyObject *
map_subscript(PyObject *self, PyObject *key)
{
    PyObject *v = u64map_get_object(self, key);
    if (v == NULL && !PyErr_Occurred()) key_error(key);
    return v;
}

static int
map_ass_subscript(PyObject *self, PyObject *key, PyObject *value)
{
    if (value != NULL) return u64map_set_object(self, key, value);
    int rc = u64map_del_object(self, key);
    if (rc == 0) key_error(key);
    return rc == 1 ? 0 : -1;
}

static int
map_contains(PyObject *self, PyObject *key)
{
    PyObject *v = u64map_get_object(self, key);
    Py_XDECREF(v);
    return v != NULL ? 1 : PyErr_Occurred() ? -1 : 0;
}

/* m.get(key, dflt) as a new reference. */
static PyObject *
get_one(PyObject *self, PyObject *key, PyObject *dflt)
{
    uint64_t k, v;
    /* The match loops' common case first: a uint64 key, found natively or absent. */
    if (PyLong_CheckExact(key) && key_u64(key, &k)) {
        int where = u64map_find(self, k, &v);
        if (where == U64_NATIVE) return PyLong_FromUnsignedLongLong(v);
        if (where == U64_ABSENT) return Py_NewRef(dflt);
    }
    PyObject *got = u64map_get_object(self, key);
    if (got != NULL || PyErr_Occurred()) return got;
    return Py_NewRef(dflt);
}

static PyObject *
map_get(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("get", nargs)) return NULL;
    return get_one(self, args[0], nargs > 1 ? args[1] : Py_None);
}

/* Keys whose places get_many asks the cache for before it looks them up. */
#define GET_AHEAD 8

/* [m.get(k, dflt) for k in keys], the lookups of the next keys started ahead of time. */
static PyObject *
map_get_many(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("get_many", nargs)) return NULL;
    PyObject *seq = PySequence_Fast(args[0], "get_many: keys must be a sequence");
    if (seq == NULL) return NULL;
    PyObject *dflt = nargs > 1 ? args[1] : Py_None;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        if (i >= PySequence_Fast_GET_SIZE(seq)) { /* a key's __eq__ shrank the list */
            PyErr_SetString(PyExc_RuntimeError, "get_many: keys changed size");
            Py_CLEAR(out);
            break;
        }
        for (Py_ssize_t j = i == 0 ? 0 : i + GET_AHEAD - 1; j < i + GET_AHEAD && j < n; j++) {
            PyObject *ahead = j < PySequence_Fast_GET_SIZE(seq) ? PySequence_Fast_GET_ITEM(seq, j)
                                                                : NULL;
            if (ahead != NULL && PyLong_CheckExact(ahead)) {
                u64map_prefetch(self, PyLong_AsUnsignedLongLongMask(ahead));
            }
        }
        PyObject *v = get_one(self, PySequence_Fast_GET_ITEM(seq, i), dflt);
        if (v == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, v);
    }
    Py_DECREF(seq);
    return out;
}

static PyObject *
map_pop(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("pop", nargs)) return NULL;
    PyObject *got = u64map_get_object(self, args[0]);
    if (got == NULL) {
        if (PyErr_Occurred()) return NULL;
        if (nargs > 1) return Py_NewRef(args[1]);
        key_error(args[0]);
        return NULL;
    }
    if (u64map_del_object(self, args[0]) < 0) Py_CLEAR(got);
    return got;
}

static PyObject *
map_setdefault(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!positional("setdefault", nargs)) return NULL;
    PyObject *got = u64map_get_object(self, args[0]);
    if (got != NULL || PyErr_Occurred()) return got;
    PyObject *value = nargs > 1 ? args[1] : Py_None;
    if (u64map_set_object(self, args[0], value) < 0) return NULL;
    return Py_NewRef(value);
}

static PyObject *
map_clear(PyObject *self, PyObject *unused)
{
    (void)unused;
    u64map_clear_all(MAP(self));
    Py_RETURN_NONE;
}

static PyObject *
map_iter(PyObject *self)
{
    return make_iter(MAP(self), IT_KEYS, -1);
}

static PyObject *
map_keys(PyObject *self, PyObject *unused)
{
    (void)unused;
    return make_iter(MAP(self), IT_KEYS, -1);
}

static PyObject *
map_values(PyObject *self, PyObject *unused)
{
    (void)unused;
    return make_iter(MAP(self), IT_VALUES, -1);
}

static PyObject *
map_items(PyObject *self, PyObject *unused)
{
    (void)unused;
    return make_iter(MAP(self), IT_ITEMS, -1);
}

static PyObject *
map_segment_of(PyObject *self, PyObject *key)
{
    segment *s = u64map_segment(MAP(self), key);
    return s == NULL ? NULL : PyLong_FromSsize_t(s - MAP(self)->seg);
}

static PyObject *
map_segment_keys(PyObject *self, PyObject *arg)
{
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= SEGMENTS) {
        PyErr_SetString(PyExc_IndexError, "segment index out of range");
        return NULL;
    }
    PyObject *it = make_iter(MAP(self), IT_KEYS, i);
    if (it == NULL) return NULL;
    PyObject *out = PySequence_List(it);
    Py_DECREF(it);
    return out;
}

/* Per segment: (entries, bytes of the native part), for tests that watch growth. */
static PyObject *
map_segment_sizes(PyObject *self, PyObject *unused)
{
    (void)unused;
    PyObject *out = PyList_New(SEGMENTS);
    for (int i = 0; out != NULL && i < SEGMENTS; i++) {
        segment *s = &MAP(self)->seg[i];
        Py_ssize_t side = s->side ? PyDict_GET_SIZE(s->side) : 0;
        Py_ssize_t bytes = (s->cap + s->old_cap) * 16; /* both tables while growing */
        PyObject *t = Py_BuildValue("(nn)", s->used + s->old_used + side, bytes);
        if (t == NULL) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, t);
    }
    return out;
}

/* Entries re-inserted by growth so far: tests bound how many one insertion moves. */
static PyObject *
map_growth_moves(PyObject *self, PyObject *unused)
{
    (void)unused;
    Py_ssize_t n = 0;
    for (int i = 0; i < SEGMENTS; i++) n += MAP(self)->seg[i].moved;
    return PyLong_FromSsize_t(n);
}

static PyObject *
map_sizeof(PyObject *self, PyObject *unused)
{
    (void)unused;
    Py_ssize_t n = Py_TYPE(self)->tp_basicsize;
    for (int i = 0; i < SEGMENTS; i++) {
        n += (MAP(self)->seg[i].cap + MAP(self)->seg[i].old_cap) * 16;
    }
    return PyLong_FromSsize_t(n);
}

static PyObject *
map_repr(PyObject *self)
{
    return PyUnicode_FromFormat("<U64Map of %zd entries>", MAP(self)->len);
}

static PyMethodDef map_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, "get(key, default=None)"},
    {"get_many", (PyCFunction)(void (*)(void))map_get_many, METH_FASTCALL,
     "get_many(keys, default=None): [get(k, default) for k in keys]"},
    {"pop", (PyCFunction)(void (*)(void))map_pop, METH_FASTCALL, "pop(key[, default])"},
    {"setdefault", (PyCFunction)(void (*)(void))map_setdefault, METH_FASTCALL,
     "setdefault(key, default=None)"},
    {"clear", map_clear, METH_NOARGS, "Remove every entry and free the segments."},
    {"keys", map_keys, METH_NOARGS, "An iterator over the keys."},
    {"values", map_values, METH_NOARGS, "An iterator over the values."},
    {"items", map_items, METH_NOARGS, "An iterator over (key, value) pairs."},
    {"segment_of", map_segment_of, METH_O, "The segment (0..15) a key belongs to."},
    {"segment_keys", map_segment_keys, METH_O, "The keys of one segment, as a list."},
    {"growth_moves", map_growth_moves, METH_NOARGS,
     "Entries re-inserted by growth so far (at most MIGRATE_STEPS per insertion or removal)."},
    {"segment_sizes", map_segment_sizes, METH_NOARGS,
     "Per segment: (entries, bytes of its native part)."},
    {"__sizeof__", map_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods map_as_mapping = {map_len, map_subscript, map_ass_subscript};
static PySequenceMethods map_as_sequence = {.sq_contains = map_contains};

PyTypeObject U64Map_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "indexer._native.U64Map",
    .tp_doc = "U64Map(items=(), /)\n--\n\nA dict for the index's big maps: uint64 -> uint64 "
              "entries in open-addressing segments, any other entry in side dicts. See "
              "indexer/u64map.py.",
    .tp_basicsize = sizeof(U64MapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = map_new,
    .tp_init = map_init,
    .tp_dealloc = map_dealloc,
    .tp_repr = map_repr,
    .tp_iter = map_iter,
    .tp_methods = map_methods,
    .tp_as_mapping = &map_as_mapping,
    .tp_as_sequence = &map_as_sequence,
    .tp_hash = PyObject_HashNotImplemented,
};

/* Slots per segment, u64map.py's _slot_segments(): about 2 ** (i / 16) each. */
static const int SEG_SLOTS[SEGMENTS] = {45, 47, 49, 51, 53, 56, 58, 61,
                                        65, 67, 70, 74, 77, 80, 84, 87};
unsigned char SLOT_SEG[SLOTS];

int
u64map_add_type(PyObject *module)
{
    int slot = 0;
    for (int i = 0; i < SEGMENTS; i++) {
        for (int j = 0; j < SEG_SLOTS[i]; j++) SLOT_SEG[slot++] = (unsigned char)i;
    }
    if (PyType_Ready(&U64Iter_Type) < 0) return -1;
    return PyModule_AddType(module, &U64Map_Type);
}
