/* indexer/_ingest.c's, _residency.c's and _removal.c's functions, registered in indexer._native's method
 * table (_native.c). */
#ifndef KVROUTER_INGEST_H
#define KVROUTER_INGEST_H

#include <Python.h>

PyObject *ingest_decode_batch(PyObject *module, PyObject *arg);
PyObject *ingest_store_dense(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ingest_store_run(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
PyObject *ingest_remove_hashes(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
