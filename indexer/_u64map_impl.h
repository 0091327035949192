/* indexer/_u64map.c's layout, shared with the Python type in _u64map_type.c (not an API). */
#ifndef KVROUTER_U64MAP_IMPL_H
#define KVROUTER_U64MAP_IMPL_H

#include "_u64map.h"

#define SEGMENTS 16
#define SLOTS 1024 /* indexer.u64map.SLOTS */
#define MIN_CAP 8

extern unsigned char SLOT_SEG[SLOTS]; /* slot -> segment, set by u64map_add_type */

typedef struct {
    uint64_t k, v; /* k 0: an empty place */
} entry;

typedef struct {
    /* What every lookup reads, first: a segment that is not growing costs one cache line. */
    entry *e; /* cap places: a hit reads one cache line */
    Py_ssize_t cap, used;
    PyObject *side;       /* dict, or NULL */
    Py_ssize_t side_ints; /* side keys that are uint64 (a value there is no uint64) */
    entry *old; /* while growing: the previous places, moved into e a few per insertion */
    /* While e has pages never written: bit p set once page p of e is (FRESH_MIN, _u64map.c). */
    unsigned char *written;
    /* Read only while growing. */
    Py_ssize_t old_cap, old_used;
    Py_ssize_t mig0, done; /* old's places mig0 .. mig0 + done - 1 (cyclic) are moved: empty */
    Py_ssize_t moved; /* entries re-inserted by growth so far (tests bound it per insertion) */
    Py_ssize_t unwritten; /* pages of e whose bit in written is still clear */
    int recycled;         /* e's unwritten pages may hold an earlier table's bytes */
} segment;

/* Zero or write every page of s's table not yet entered: before reading it place by place. */
void u64map_settle(segment *s);

typedef struct {
    PyObject_HEAD
    Py_ssize_t len;
    uint64_t version; /* changes with every insertion or deletion: iterators check it */
    segment seg[SEGMENTS];
} U64MapObject;

#define MAP(o) ((U64MapObject *)(o))

static inline uint64_t
fmix64(uint64_t k)
{
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdull;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ull;
    k ^= k >> 33;
    return k;
}

static inline segment *
seg_of(U64MapObject *m, uint64_t low)
{
    return &m->seg[SLOT_SEG[low & (SLOTS - 1)]];
}

/* The segment of any key: k & 1023 for an int (two's complement), hash(key) & 1023 else;
 * NULL with an error set when the key is unhashable. */
segment *u64map_segment(U64MapObject *m, PyObject *key);

/* 1 when key is an int in [1, 2**64) (*k set), else 0; never an error. */
static inline int
key_u64(PyObject *key, uint64_t *k)
{
    if (!PyLong_Check(key)) return 0;
    uint64_t v = PyLong_AsUnsignedLongLong(key);
    if (v == (uint64_t)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *k = v;
    return v != 0;
}

/* Free every segment. */
void u64map_clear_all(U64MapObject *m);

#endif
