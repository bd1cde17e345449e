/* shard_index and ShardLock in C: the twins of _shard_py.py, which documents the behaviour and is
 * the reference (tests/test_shard_twins.py compares the two). */

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

/* ShardLock: threading.Lock's blocking acquire() and release(), as METH_NOARGS methods.
 * threading.Lock's acquire(blocking=True, timeout=-1) parses its optional arguments with
 * PyArg_ParseTupleAndKeywords on every call, even with none: ~400 instructions of a ~5,000
 * instruction 4 KiB GET. The lock itself is the same PyThread lock. */

typedef struct {
    PyObject_HEAD
    PyThread_type_lock lock;
    char locked; /* written only by the holder, under the GIL */
} ShardLock;

static PyObject *
lock_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ShardLock() takes no arguments");
        return NULL;
    }
    ShardLock *self = (ShardLock *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->lock = PyThread_allocate_lock();
    if (self->lock == NULL) {
        Py_DECREF(self);
        PyErr_SetString(PyExc_MemoryError, "cannot allocate a lock");
        return NULL;
    }
    return (PyObject *)self;
}

static void
lock_dealloc(ShardLock *self)
{
    PyTypeObject *type = Py_TYPE(self);
    if (self->lock != NULL) {
        if (self->locked) {
            PyThread_release_lock(self->lock); /* as threading.Lock: freeing a held lock is allowed */
        }
        PyThread_free_lock(self->lock);
    }
    type->tp_free(self);
    Py_DECREF(type); /* a heap type */
}

static PyObject *
lock_acquire(ShardLock *self, PyObject *unused)
{
    (void)unused;
    if (!PyThread_acquire_lock(self->lock, NOWAIT_LOCK)) {
        /* Held by another thread: wait without the GIL, or the holder could never release it. */
        Py_BEGIN_ALLOW_THREADS
        PyThread_acquire_lock(self->lock, WAIT_LOCK);
        Py_END_ALLOW_THREADS
    }
    self->locked = 1;
    Py_RETURN_TRUE;
}

static PyObject *
lock_release(ShardLock *self, PyObject *unused)
{
    (void)unused;
    if (!self->locked) {
        PyErr_SetString(PyExc_RuntimeError, "release unlocked lock");
        return NULL;
    }
    self->locked = 0;
    PyThread_release_lock(self->lock);
    Py_RETURN_NONE;
}

static PyObject *
lock_exit(ShardLock *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)args;
    (void)nargs;
    return lock_release(self, NULL);
}

static PyObject *
lock_locked(ShardLock *self, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(self->locked);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)lock_acquire, METH_NOARGS, "Wait for the lock and take it; returns True."},
    {"release", (PyCFunction)lock_release, METH_NOARGS, "Give the lock back; RuntimeError if unlocked."},
    {"locked", (PyCFunction)lock_locked, METH_NOARGS, "Whether the lock is held."},
    {"__enter__", (PyCFunction)lock_acquire, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))lock_exit, METH_FASTCALL, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot lock_slots[] = {
    {Py_tp_new, lock_new},
    {Py_tp_dealloc, lock_dealloc},
    {Py_tp_methods, lock_methods},
    {Py_tp_doc, "ShardLock() -> a lock: see lmserver/_shard_py.py."},
    {0, NULL},
};

static PyType_Spec lock_spec = {
    .name = "lmserver._shard_c.ShardLock",
    .basicsize = sizeof(ShardLock),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = lock_slots,
};

static int
add_types(PyObject *module)
{
    PyObject *type = PyType_FromSpec(&lock_spec);
    if (type == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(module, "ShardLock", type);
    Py_DECREF(type);
    return rc;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, add_types},
    {0, NULL},
};

static PyMethodDef methods[] = {
    {"shard_index", (PyCFunction)(void (*)(void))shard_index, METH_FASTCALL,
     "shard_index(key, shards) -> hash(key) % shards: see lmserver/_shard_py.py."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef shard_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmserver._shard_c",
    .m_doc = "shard_index and ShardLock compiled: the C twins of lmserver/_shard_py.py.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__shard_c(void)
{
    return PyModuleDef_Init(&shard_module);
}
