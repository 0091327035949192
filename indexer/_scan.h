/* indexer/_scan.c's run_scan, registered in indexer._native's method table (_native.c). */
#ifndef KVROUTER_SCAN_H
#define KVROUTER_SCAN_H

#include <Python.h>

PyObject *native_run_scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs);

#endif
