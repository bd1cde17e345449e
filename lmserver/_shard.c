/* shard_index in C: the twin of _shard.py, which documents the behaviour and is the reference
 * (tests/test_c_twins.py compares the two). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *
shard_index(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "shard_index(key, shards)");
        return NULL;
    }
    Py_hash_t hash = PyObject_Hash(args[0]); /* cached on a str after the first time */
    if (hash == -1) {
        return NULL;
    }
    Py_ssize_t shards = PyLong_AsSsize_t(args[1]);
    if (shards <= 0) {
        if (shards == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                return NULL; /* not an int: TypeError */
            }
            PyErr_Clear();
        }
        PyErr_Format(PyExc_ValueError, "shards must be in 1..%zd, not %R", PY_SSIZE_T_MAX, args[1]);
        return NULL;
    }
    Py_ssize_t index = hash % shards; /* C rounds toward zero; Python's % is never negative here */
    return PyLong_FromSsize_t(index < 0 ? index + shards : index);
}

static PyMethodDef methods[] = {
    {"shard_index", (PyCFunction)(void (*)(void))shard_index, METH_FASTCALL,
     "shard_index(key, shards) -> hash(key) % shards: see lmserver/_shard.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef shard_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmserver._shard",
    .m_doc = "shard_index compiled: the C twin of lmserver/_shard.py.",
    .m_size = 0,
    .m_methods = methods,
};

PyMODINIT_FUNC
PyInit__shard(void)
{
    return PyModuleDef_Init(&shard_module);
}
