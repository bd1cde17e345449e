/* framed_copy and send_nowait in C: the twins of _framed.py, which documents the behaviour and
 * is the reference (tests/test_c_twins.py compares the two). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <string.h>
#include <sys/socket.h>

static PyObject *
framed_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "framed_copy(header, buffer, length)");
        return NULL;
    }
    PyObject *header = args[0];
    if (!PyBytes_Check(header)) {
        PyErr_Format(PyExc_TypeError, "header must be bytes, not %s", Py_TYPE(header)->tp_name);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t length = PyLong_AsSsize_t(args[2]);
    if (length == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyBuffer_Release(&view);
            return NULL; /* not an int: TypeError, as the Python twin */
        }
        PyErr_Clear(); /* too large either way: the ValueError below */
    }
    PyObject *reply = NULL;
    if (length < 0 || length > view.len) {
        PyErr_Format(PyExc_ValueError, "length must be in 0..%zd, not %R", view.len, args[2]);
    }
    else {
        Py_ssize_t head = PyBytes_GET_SIZE(header);
        reply = PyBytes_FromStringAndSize(NULL, head + length);
        if (reply != NULL) {
            memcpy(PyBytes_AS_STRING(reply), PyBytes_AS_STRING(header), (size_t)head);
            memcpy(PyBytes_AS_STRING(reply) + head, view.buf, (size_t)length);
        }
    }
    PyBuffer_Release(&view);
    return reply;
}

static PyObject *
send_nowait(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send_nowait(fd, data)");
        return NULL;
    }
    if (!PyLong_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "fd must be an int, not %s", Py_TYPE(args[0])->tp_name);
        return NULL;
    }
    int overflow = 0;
    long fd = PyLong_AsLongAndOverflow(args[0], &overflow);
    if (overflow || fd < 0 || fd > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "fd must be in 0..%d, not %R", INT_MAX, args[0]);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    /* The GIL stays held: the socket is non-blocking, so send() never waits (uvloop's writes
     * run the same way). MSG_NOSIGNAL: a peer that is gone is an EPIPE, not a SIGPIPE. */
    ssize_t sent;
    do {
        sent = send((int)fd, view.buf, (size_t)view.len, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    PyBuffer_Release(&view);
    return PyLong_FromSsize_t(sent < 0 ? 0 : sent);
}

static PyMethodDef methods[] = {
    {"framed_copy", (PyCFunction)(void (*)(void))framed_copy, METH_FASTCALL,
     "framed_copy(header, buffer, length) -> header + buffer[:length]: see lmserver/_framed.py."},
    {"send_nowait", (PyCFunction)(void (*)(void))send_nowait, METH_FASTCALL,
     "send_nowait(fd, data) -> bytes sent with one send(2), 0 if none: see lmserver/_framed.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framed_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmserver._framed",
    .m_doc = "framed_copy and send_nowait compiled: the C twins of lmserver/_framed.py.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__framed(void)
{
    return PyModuleDef_Init(&framed_module);
}
