/* Buffer checks shared by the native loops that take keys as a list or a buffer. */
#ifndef KVROUTER_BUFFERS_H
#define KVROUTER_BUFFERS_H

#include <Python.h>

/* Whether view is a 1-D buffer of native uint64 (numpy uint64, array('Q'), memoryview cast 'Q'). */
static inline int
is_u64_vector(const Py_buffer *view)
{
    const char *f = view->format == NULL ? "B" : view->format;
    if (f[0] == '@') {
        f++;
    }
    return view->ndim == 1 && view->itemsize == 8 && (f[0] == 'Q' || f[0] == 'L') && f[1] == '\0';
}

#endif
