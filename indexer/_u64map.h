/* indexer/_u64map.c's map type and its C API, for the index's loops in _ingest.c and _native.c.
 *
 * A U64Map holds uint64 keys (not 0) with uint64 values in its own open-addressing segments;
 * any other entry (bytes or negative keys, key 0, values that are not ints in [0, 2**64)) sits in
 * a side dict of the key's segment. The functions below take the uint64 case without a Python
 * object and say when an entry is in a side dict, so that the caller can take the object path.
 */
#ifndef KVROUTER_U64MAP_H
#define KVROUTER_U64MAP_H

#include <Python.h>
#include <stdint.h>

extern PyTypeObject U64Map_Type;
#define U64Map_Check(op) PyObject_TypeCheck(op, &U64Map_Type)

enum { U64_ABSENT = 0, U64_NATIVE = 1, U64_SIDE = 2 };

/* Key k: U64_NATIVE with *v set, U64_ABSENT, U64_SIDE (in a side dict: use the object API), or
 * -1 with an error set. */
int u64map_find(PyObject *m, uint64_t k, uint64_t *v);

/* Start loading the place of key k into the cache (a hint, no effect on the map): issued a few
 * keys ahead, the lookups of a scan wait on memory together instead of one after another. */
void u64map_prefetch(PyObject *m, uint64_t k);

/* m[k] = v. 0, or -1 with an error set (no memory). */
int u64map_put(PyObject *m, uint64_t k, uint64_t v);

/* m.setdefault(k, v): 1 inserted, 0 already there natively (*old set), U64_SIDE already there
 * in a side dict, -1 with an error set. */
int u64map_put_new(PyObject *m, uint64_t k, uint64_t v, uint64_t *old);

/* del m[k]: 1 removed, 0 absent, -1 with an error set. Never allocates for a native entry. */
int u64map_remove(PyObject *m, uint64_t k);

/* The object API (any key, any value), as the Python methods use it. */
PyObject *u64map_get_object(PyObject *m, PyObject *key); /* new ref; NULL: absent or error */
int u64map_set_object(PyObject *m, PyObject *key, PyObject *value); /* 0, -1 error */
int u64map_del_object(PyObject *m, PyObject *key);                  /* 1, 0 absent, -1 */

/* Adds U64Map to the module (its exec slot). */
int u64map_add_type(PyObject *module);

#endif
