/*
 * U64Map: the index's big maps (content key -> engine mask, engine hash -> content key) as
 * uint64 -> uint64 open addressing, part of indexer._native. indexer/u64map.py has the
 * pure-Python reference (PyU64Map) and says why the map is split in segments.
 *
 * Layout: SEGMENTS segments; key k belongs to segment SLOT_SEG[k & 1023] (any other key:
 * hash(key) & 1023), the slot shares of u64map.py, so segments reach their growth points at
 * different moments. A segment is a table of cap (key, value) places (a PyMem block; from
 * 256 KiB a mapping of its own, table_new), linear probing from murmur3's fmix64(k), key 0
 * meaning empty; deletion shifts the following entries back,
 * so churn leaves no tombstones and probe runs stay as short as the load allows. A segment
 * doubles when it passes 5/8 full (a lower load shortens the runs a deletion shifts back: under
 * vLLM's churn of single-block removals, 5/8 rather than 3/4 takes a tenth off the event plane's
 * CPU for a fifth more memory, docs/benchmarks.md): that growth re-inserts only that segment's
 * entries, at most 87/1024 of the map's (the largest share) give or take the chance deviation
 * of its fill, and spreads the re-insertion over the insertions that follow (MIGRATE_STEPS).
 *
 * Entries that are not (uint64 key != 0, uint64 value) -- bytes hashes, negative ints, key 0,
 * masks of engines past slot 63 -- live in the segment's side dict, so the map is a dict for
 * every key and value; side_ints counts the side keys a uint64 lookup must also look for.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>
#include <unistd.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

#include "_u64map_impl.h"

/* ------------------------------------------------------------------ native part */

/* The place of k in table e of cap places, or of the empty place ending its probe run (-1 when
 * cap is 0). */
static inline Py_ssize_t
probe_in(const entry *e, Py_ssize_t cap, uint64_t k)
{
    if (cap == 0) {
        return -1;
    }
    size_t mask = (size_t)cap - 1, i = (size_t)fmix64(k) & mask;
    while (e[i].k != 0 && e[i].k != k) {
        i = (i + 1) & mask;
    }
    return (Py_ssize_t)i;
}

/* Write before read on a grown table's new pages. A new table of FRESH_MIN bytes or more
 * comes from the kernel untouched; the first access to each of its pages is a fault, and when
 * that access is a read (a probe), the kernel maps its shared zero page, so the insertion that
 * then writes there faults a second time and, to replace the zero page, flushes the TLB of every
 * CPU the process runs on (an inter-processor interrupt: ZMQ's I/O thread is on the other core).
 * At 1M insertions a second into a growing index that was most of the subscriber's system time
 * and the source of its slowest loop turns (docs/benchmarks.md). So while e has pages no one
 * wrote, a probe that enters such a page first writes it (an atomic add of 0: a write that
 * changes nothing; or, in a table kept from an earlier one (table_new), zeroes it), one fault at
 * most per page, and marks it in s->written. Every write to e goes to a place a probe entered,
 * so no page holds an entry before it is marked; iteration writes every unmarked page first
 * (u64map_settle). Bound: one bit per page of the growing segment's new table (1 KiB for a 32
 * MiB table), freed once every page is written, at the latest when the move ends. */
#define FRESH_MIN (256 * 1024)
static size_t page_size = 4096; /* the system's, read by mark_fresh */
static void table_free(entry *t, Py_ssize_t cap);

static inline void
write_page(segment *s, size_t i)
{
    uintptr_t page = (uintptr_t)&s->e[i] / page_size;
    size_t pg = (size_t)(page - (uintptr_t)s->e / page_size);
    if (s->written[pg >> 3] & (1u << (pg & 7))) return;
    if (s->recycled) {
        memset((void *)(page * page_size), 0, page_size);
    } else {
        __atomic_fetch_add(&s->e[i].k, 0, __ATOMIC_RELAXED);
    }
    s->written[pg >> 3] |= (unsigned char)(1u << (pg & 7));
    if (--s->unwritten == 0) {
        PyMem_Free(s->written);
        s->written = NULL;
    }
}

/* Whether place i of e starts a page. */
static inline int
page_start(const segment *s, size_t i)
{
    return (uintptr_t)&s->e[i] % page_size < sizeof(entry);
}

/* probe_in on s->e, writing each page it enters that no one wrote yet. */
static inline Py_ssize_t
probe_e(segment *s, uint64_t k)
{
    if (s->written == NULL) return probe_in(s->e, s->cap, k);
    size_t mask = (size_t)s->cap - 1, i = (size_t)fmix64(k) & mask;
    write_page(s, i);
    while (s->e[i].k != 0 && s->e[i].k != k) {
        i = (i + 1) & mask;
        if (s->written != NULL && page_start(s, i)) write_page(s, i);
    }
    return (Py_ssize_t)i;
}

/* Write every page of s->e no one wrote yet, and drop the marks (_u64map_impl.h). */
void
u64map_settle(segment *s)
{
    if (s->written == NULL) return;
    size_t per = page_size / sizeof(entry);
    size_t first = (page_size - (uintptr_t)s->e % page_size) % page_size / sizeof(entry);
    write_page(s, 0);
    for (size_t i = first; s->written != NULL && i < (size_t)s->cap; i += per) {
        write_page(s, i);
    }
}

/* Start marking the pages of the new table e (cap places) written; without memory for the
 * marks, the table is used as it is. */
static void
mark_fresh(segment *s)
{
    PyMem_Free(s->written);
    s->written = NULL;
    size_t bytes = (size_t)s->cap * sizeof(entry);
    if (bytes < FRESH_MIN) return;
    long ps = sysconf(_SC_PAGESIZE);
    if (ps >= (long)sizeof(entry) && (ps & (ps - 1)) == 0) page_size = (size_t)ps;
    uintptr_t first = (uintptr_t)s->e / page_size;
    uintptr_t last = ((uintptr_t)s->e + bytes - 1) / page_size;
    size_t pages = (size_t)(last - first + 1);
    s->written = PyMem_Calloc((pages + 7) / 8, 1);
    s->unwritten = s->written != NULL ? (Py_ssize_t)pages : 0;
}

/* Whether native key k may be in the previous table of a growing segment: not when its home
 * lies among the places already moved (they are empty, and the move takes whole probe runs, so
 * no entry left there has a run through them). */
static inline int
in_old(const segment *s, uint64_t k)
{
    if (s->old == NULL) return 0;
    size_t mask = (size_t)s->old_cap - 1;
    return (Py_ssize_t)(((size_t)fmix64(k) - (size_t)s->mig0) & mask) >= s->done;
}

/* The entry of native key k in s (its table, or the previous one while growing), or NULL;
 * *at, when given, is set to k's place in the table or the empty place where it would go. */
static inline entry *
lookup(segment *s, uint64_t k, Py_ssize_t *at)
{
    Py_ssize_t i = probe_e(s, k);
    if (at != NULL) *at = i;
    if (i >= 0 && s->e[i].k == k) return &s->e[i];
    if (in_old(s, k)) {
        i = probe_in(s->old, s->old_cap, k);
        if (s->old[i].k == k) return &s->old[i];
    }
    return NULL;
}

/* Empty place i of table e, shifting back the entries of its probe run that may move (no
 * tombstones). */
static void
erase_in(entry *e, Py_ssize_t cap, size_t i, segment *fresh)
{
    size_t mask = (size_t)cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (fresh != NULL && fresh->written != NULL && page_start(fresh, j)) write_page(fresh, j);
        if (e[j].k == 0) break;
        size_t home = (size_t)fmix64(e[j].k) & mask;
        /* The entry at j stays unless its home lies cyclically outside (i, j]. */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            e[i] = e[j];
            i = j;
        }
    }
    e[i].k = 0;
}

/* Growth is incremental: doubling a segment allocates the new table and leaves the entries in
 * the old one, from which every insertion (and removal) moves the next MIGRATE_STEPS places'
 * worth, in place order from an empty place, a whole probe run at a time (a run moved in part
 * would leave entries whose runs cross emptied places, which lookups would stop at); lookups
 * look in both meanwhile. So no operation re-inserts more than MIGRATE_STEPS entries plus the
 * rest of the run the last one is in (runs at 5/8 load are tens of places), and a growing map
 * of millions never stops its caller for a whole segment's re-insertion (a stall the event loop
 * would pay in lag). Every place moves once, in at most old_cap / MIGRATE_STEPS insertions, long
 * before the new table (5/16 full at the start, 5/8 its growth point) needs to grow again; were
 * it to, the move is finished at once first.
 * A segment of fewer than INCREMENTAL_CAP places grows at once: it costs microseconds. */
#define MIGRATE_STEPS 64
#define INCREMENTAL_CAP 1024

/* Move the old table's probe run starting at place i (the place before it is empty or moved)
 * into e and empty its places; the number of places. */
static Py_ssize_t
move_run(segment *s, size_t i)
{
    size_t mask = (size_t)s->old_cap - 1;
    Py_ssize_t n = 0;
    for (; s->old[i].k != 0; i = (i + 1) & mask, n++) {
        entry *o = &s->old[i];
        Py_ssize_t at = probe_e(s, o->k); /* absent there: in one table only */
        s->e[at] = *o;
        o->k = 0;
    }
    s->used += n;
    s->old_used -= n;
    s->moved += n;
    return n;
}

/* Move at least steps places of the old table (a run is moved whole) and free it when none is
 * left. */
static void
migrate(segment *s, Py_ssize_t steps)
{
    if (s->old == NULL) return;
    size_t mask = (size_t)s->old_cap - 1;
    while (steps > 0 && s->old_used > 0 && s->done < s->old_cap) {
        size_t i = ((size_t)s->mig0 + (size_t)s->done) & mask;
        Py_ssize_t n = s->old[i].k != 0 ? move_run(s, i) : 0;
        s->done += n + 1; /* the run and the empty place after it */
        steps -= n + 1;
    }
    if (s->old_used == 0) {
        u64map_settle(s);
        table_free(s->old, s->old_cap);
        s->old = NULL;
        s->old_cap = s->old_used = s->mig0 = s->done = 0;
    }
}

/* Table memory. A table of FRESH_MIN bytes or more is a mapping of its own, and a table that
 * growth leaves behind goes to a pool instead of back to the kernel: a new page costs a fault
 * (1.4 us on a quiet host, 10-16 us on a busy one, most of a growing index's system time),
 * zeroing a kept one on first touch about 0.1 us. A new table takes a pooled one of its size,
 * or grows the largest smaller one in place of a fresh mapping (mremap: the kept pages move
 * with it, the rest are new), and its pages are zeroed as they are first entered (write_page).
 * Bound: the pool holds at most POOL_TABLES tables and max(POOL_MIN, a quarter of the bytes of
 * the tables in use); past it tables are unmapped. */
#define POOL_TABLES 64
#define POOL_MIN ((size_t)64 << 20)
#ifdef __linux__
static struct {
    void *p;
    size_t bytes;
} pool[POOL_TABLES];
static int pool_n;
static size_t pool_bytes, live_bytes;

static void
pool_trim(void)
{
    size_t bound = live_bytes / 4 > POOL_MIN ? live_bytes / 4 : POOL_MIN;
    while (pool_n > 0 && pool_bytes > bound) {
        pool_n--;
        munmap(pool[pool_n].p, pool[pool_n].bytes);
        pool_bytes -= pool[pool_n].bytes;
    }
}
#endif

/* A zeroed table of cap places (*recycled = 0), or one whose pages write_page must zero
 * (*recycled = 1); NULL: no memory. */
static entry *
table_new(Py_ssize_t cap, int *recycled)
{
    size_t bytes = (size_t)cap * sizeof(entry);
    *recycled = 0;
#ifdef __linux__
    if (bytes >= FRESH_MIN) {
        int best = -1;
        for (int i = 0; i < pool_n; i++) {
            if (pool[i].bytes <= bytes && (best < 0 || pool[i].bytes > pool[best].bytes)) {
                best = i;
            }
        }
        void *p = MAP_FAILED;
        if (best >= 0) {
            p = pool[best].bytes == bytes
                    ? pool[best].p
                    : mremap(pool[best].p, pool[best].bytes, bytes, MREMAP_MAYMOVE);
            if (p != MAP_FAILED) {
                pool_bytes -= pool[best].bytes;
                pool[best] = pool[--pool_n];
                *recycled = 1;
            }
        }
        if (p == MAP_FAILED) {
            p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        }
        if (p == MAP_FAILED) return NULL;
        live_bytes += bytes;
        return (entry *)p;
    }
#endif
    return PyMem_Calloc((size_t)cap, sizeof(entry));
}

/* Give back table t of cap places (NULL: nothing). */
static void
table_free(entry *t, Py_ssize_t cap)
{
    if (t == NULL) return;
#ifdef __linux__
    size_t bytes = (size_t)cap * sizeof(entry);
    if (bytes >= FRESH_MIN) {
        live_bytes -= bytes;
        if (pool_n < POOL_TABLES) {
            pool[pool_n].p = t, pool[pool_n].bytes = bytes;
            pool_n++;
            pool_bytes += bytes;
        } else {
            munmap(t, bytes);
        }
        pool_trim();
        return;
    }
#endif
    PyMem_Free(t);
}

static int
grow(segment *s)
{
    migrate(s, PY_SSIZE_T_MAX); /* a move still under way ends first */
    Py_ssize_t cap = s->cap ? s->cap * 2 : MIN_CAP;
    if ((size_t)cap > PY_SSIZE_T_MAX / 16) {
        PyErr_NoMemory();
        return -1;
    }
    int recycled;
    entry *e = table_new(cap, &recycled);
    if (e == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->old = s->e, s->old_cap = s->cap, s->old_used = s->used, s->done = 0;
    s->e = e, s->cap = cap, s->used = 0;
    s->recycled = recycled;
    mark_fresh(s);
    if (recycled && s->written == NULL) { /* no memory for the marks: zero it now */
        memset(e, 0, (size_t)cap * sizeof(entry));
        s->recycled = 0;
    }
    s->mig0 = 0; /* the move starts after an empty place (a 5/8 full table has one) */
    while (s->old_used > 0 && s->old[(s->mig0 - 1) & (s->old_cap - 1)].k != 0) s->mig0++;
    if (s->old_used == 0 || s->old_cap < INCREMENTAL_CAP) {
        migrate(s, PY_SSIZE_T_MAX);
    }
    return 0;
}

/* Insert or update: 1 inserted, 0 updated (*old set if old), -1 no memory. */
static int
native_set(segment *s, uint64_t k, uint64_t v, uint64_t *old, int keep)
{
    Py_ssize_t i; /* where k goes in e, unless e changes below */
    entry *p = lookup(s, k, &i);
    if (p != NULL) {
        if (old != NULL) *old = p->v;
        if (!keep) p->v = v;
        return 0;
    }
    if (s->old != NULL) {
        migrate(s, MIGRATE_STEPS);
        i = -1; /* a moved entry may have taken place i */
    }
    if (s->used + s->old_used + 1 > s->cap / 8 * 5) { /* MAX_LOAD: 5/8 */
        if (grow(s) < 0) return -1;
        i = -1;
    }
    if (i < 0) i = probe_e(s, k);
    s->e[i].k = k;
    s->e[i].v = v;
    s->used++;
    return 1;
}

/* Remove native key k from s: 1 removed, 0 absent. */
static int
native_remove(segment *s, uint64_t k)
{
    Py_ssize_t i = probe_e(s, k);
    if (i >= 0 && s->e[i].k == k) {
        erase_in(s->e, s->cap, (size_t)i, s);
        s->used--;
    } else if (in_old(s, k) && s->old[i = probe_in(s->old, s->old_cap, k)].k == k) {
        erase_in(s->old, s->old_cap, (size_t)i, NULL);
        s->old_used--;
    } else {
        return 0;
    }
    migrate(s, MIGRATE_STEPS);
    return 1;
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
        const entry *p = lookup(s, k, NULL);
        if (p != NULL) {
            *v = p->v;
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
#if defined(__GNUC__) || defined(__clang__)
    if (s->cap != 0) {
        __builtin_prefetch(&s->e[(size_t)fmix64(k) & ((size_t)s->cap - 1)]);
    }
    if (s->old != NULL) {
        __builtin_prefetch(&s->old[(size_t)fmix64(k) & ((size_t)s->old_cap - 1)]);
    }
#endif
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
    if (k != 0 && native_remove(s, k)) {
        m->len--;
        m->version++;
        return 1;
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
        const entry *p = lookup(s, k, NULL);
        if (p != NULL) return PyLong_FromUnsignedLongLong(p->v);
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
        if (native_key && native_remove(s, k)) { /* moves to the side dict */
            m->len--, m->version++;
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
        if (native_remove(s, k)) {
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
        table_free(s->e, s->cap);
        table_free(s->old, s->old_cap);
        PyMem_Free(s->written);
        s->e = s->old = NULL;
        s->written = NULL;
        s->unwritten = s->recycled = 0;
        s->cap = s->used = s->side_ints = s->old_cap = s->old_used = s->mig0 = s->done = 0;
        Py_CLEAR(s->side);
    }
    m->len = 0;
    m->version++;
}
