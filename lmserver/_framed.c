/* framed_copy in C: the twin of _framed.py, which documents the behaviour and is the reference
 * (tests/test_c_twins.py compares the two). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

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

static PyMethodDef methods[] = {
    {"framed_copy", (PyCFunction)(void (*)(void))framed_copy, METH_FASTCALL,
     "framed_copy(header, buffer, length) -> header + buffer[:length]: see lmserver/_framed.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef framed_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmserver._framed",
    .m_doc = "framed_copy compiled: the C twin of lmserver/_framed.py.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__framed(void)
{
    return PyModuleDef_Init(&framed_module);
}
