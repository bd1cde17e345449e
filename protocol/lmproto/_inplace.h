/* Reading (or receiving into) a buffer object in place, for a C call that neither releases
 * the GIL nor runs Python code while it uses the memory: lmproto/_lookup_c.c's key scan and
 * lmserver/_framed_c.c's recv and reply copy. Include after <Python.h>.
 *
 * Why: PyObject_GetBuffer on a memoryview copies its whole Py_buffer and counts an export,
 * and PyBuffer_Release undoes both: ~90 instructions per buffer, three buffers per sequential
 * GET (the staging buffer received into, the same scanned for the key, the object copied
 * out). For the objects the server passes (a memoryview, a bytearray, bytes) the pointer and
 * length can be read where they are. That is sound only while nothing can release the
 * memoryview or resize the bytearray under the call: no Python code may run between
 * inplace_get and the last use of the memory (the export PyObject_GetBuffer takes is what
 * would otherwise forbid both). Any other object, or a memoryview that is released,
 * non-contiguous or read-only where writing is asked, goes through PyObject_GetBuffer, which
 * also raises the errors that fit. */

#ifndef LMPROTO_INPLACE_H
#define LMPROTO_INPLACE_H

typedef struct {
    char *buf;
    Py_ssize_t len;
    int exported; /* whether `view` holds an export that inplace_release gives back */
    Py_buffer view;
} InPlace;

/* `obj`'s bytes into *in (writable ones if `writable`); 0, or -1 with an exception. */
static inline int
inplace_get(PyObject *obj, InPlace *in, int writable)
{
    in->exported = 0;
    if (PyMemoryView_Check(obj)) { /* memoryview has no subclasses */
        PyMemoryViewObject *mv = (PyMemoryViewObject *)obj;
        if (!(mv->flags & _Py_MEMORYVIEW_RELEASED) && (mv->flags & _Py_MEMORYVIEW_C)
            && !(writable && mv->view.readonly)) {
            in->buf = mv->view.buf;
            in->len = mv->view.len;
            return 0;
        }
    }
    else if (PyByteArray_CheckExact(obj)) {
        in->buf = PyByteArray_AS_STRING(obj);
        in->len = PyByteArray_GET_SIZE(obj);
        return 0;
    }
    else if (!writable && PyBytes_CheckExact(obj)) {
        in->buf = PyBytes_AS_STRING(obj);
        in->len = PyBytes_GET_SIZE(obj);
        return 0;
    }
    if (PyObject_GetBuffer(obj, &in->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        return -1;
    }
    in->exported = 1;
    in->buf = in->view.buf;
    in->len = in->view.len;
    return 0;
}

static inline void
inplace_release(InPlace *in)
{
    if (in->exported) {
        PyBuffer_Release(&in->view);
        in->exported = 0;
    }
}

#endif
