/* decode_lookup in C: the twin of _lookup_py.py, which documents the behaviour and is the
 * reference (tests/test_lookup_twins.py compares the two on every kind of header). Read that
 * file first.
 *
 * The key scan itself is in _keyscan.h, shared with lmserver/_framed_c.c. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_inplace.h"
#include "_keyscan.h"

#define RUN_MAX 64 /* keys per decode_lookups call: the _lookup_py.py twin's RUN_MAX */

/* (command, key) as a new tuple; steals the reference to key. */
static PyObject *
pair(int32_t command, PyObject *key)
{
    if (key == NULL) {
        return NULL;
    }
    PyObject *number = PyLong_FromLong(command);
    if (number == NULL) {
        Py_DECREF(key);
        return NULL;
    }
    PyObject *result = PyTuple_New(2);
    if (result == NULL) {
        Py_DECREF(number);
        Py_DECREF(key);
        return NULL;
    }
    PyTuple_SET_ITEM(result, 0, number); /* steals both references */
    PyTuple_SET_ITEM(result, 1, key);
    return result;
}

static PyObject *
decode_lookup(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "decode_lookup(buf, generation, offset=0)");
        return NULL;
    }
    Py_ssize_t key_at = key_offset(args[1]);
    Py_ssize_t offset = 0;
    if (key_at < 0 || (nargs == 3 && read_index(args[2], &offset) < 0)) {
        return NULL;
    }
    InPlace buf; /* the scan allocates a str and runs no Python code */
    if (inplace_get(args[0], &buf, 0) < 0) {
        return NULL;
    }
    if (offset < 0 || buf.len - offset < key_at + KEY_SIZE) {
        inplace_release(&buf);
        return no_header();
    }
    const unsigned char *header = (const unsigned char *)buf.buf + offset;
    int32_t command = read_i32_le(header);
    int32_t length = read_i32_le(header + 4);
    PyObject *key = length ? PyUnicode_New(0, 0) : ascii_key(header + key_at);
    inplace_release(&buf);
    return pair(command, key);
}

/* Releases keys[from:count]: the keys a failed call still holds. */
static void
release_keys(PyObject *keys[RUN_MAX], Py_ssize_t from, Py_ssize_t count)
{
    while (count > from) {
        Py_DECREF(keys[--count]);
    }
}

/* The keys of the run of lookups at buf[start:end] into keys[] (new references, at most
 * RUN_MAX of them), the command of the first header into *command; their count, or -1 with an
 * exception (nothing left in keys[]). Collected first, so the caller makes its tuple once at its
 * size or appends them to its list. */
static Py_ssize_t
lookup_run(const unsigned char *buf, Py_ssize_t start, Py_ssize_t end, Py_ssize_t key_at, int32_t *command,
           PyObject *keys[RUN_MAX])
{
    Py_ssize_t count = 0;
    Py_ssize_t size = key_at + KEY_SIZE;
    *command = read_i32_le(buf + start);
    if (*command == EXIST || *command == GET) {
        for (Py_ssize_t at = start; count < RUN_MAX && end - at >= size; at += size) {
            if (read_i32_le(buf + at) != *command || read_i32_le(buf + at + 4) != 0) {
                break; /* another command, or a body follows */
            }
            PyObject *key = ascii_key(buf + at + key_at);
            if (key == NULL) {
                release_keys(keys, 0, count);
                return -1;
            }
            if (PyUnicode_GET_LENGTH(key) == 0) {
                Py_DECREF(key);
                break; /* a key this scan does not take: decode_request's */
            }
            keys[count++] = key;
        }
    }
    return count;
}

/* The run at buf[start:end] as decode_lookups and decode_lookups_into take it: the arguments
 * checked, the keys into keys[]; their count, or -1 with an exception. */
static Py_ssize_t
lookup_args(PyObject *const *args, int32_t *command, PyObject *keys[RUN_MAX])
{
    Py_ssize_t key_at = key_offset(args[1]);
    Py_ssize_t start, end;
    if (key_at < 0 || read_index(args[2], &start) < 0 || read_index(args[3], &end) < 0) {
        return -1;
    }
    InPlace buf; /* the scan allocates strs and runs no Python code */
    if (inplace_get(args[0], &buf, 0) < 0) {
        return -1;
    }
    if (start < 0 || end > buf.len || end - start < key_at + KEY_SIZE) {
        inplace_release(&buf);
        no_header();
        return -1;
    }
    Py_ssize_t count = lookup_run((const unsigned char *)buf.buf, start, end, key_at, command, keys);
    inplace_release(&buf);
    return count;
}

static PyObject *
decode_lookups(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "decode_lookups(buf, generation, start, end)");
        return NULL;
    }
    PyObject *keys[RUN_MAX];
    int32_t command;
    Py_ssize_t count = lookup_args(args, &command, keys);
    if (count < 0) {
        return NULL;
    }
    PyObject *run = PyTuple_New(count);
    if (run == NULL) {
        release_keys(keys, 0, count);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyTuple_SET_ITEM(run, i, keys[i]); /* steals the reference */
    }
    return pair(command, run);
}

/* The list emptied in place: its items released, its allocation kept, so the appends that
 * refill it allocate nothing (list.clear() would free the allocation). The size is set to 0
 * before any item is released, so code a release may run sees an empty list. */
static void
empty_list(PyObject *list)
{
    Py_ssize_t n = PyList_GET_SIZE(list);
    PyObject **items = ((PyListObject *)list)->ob_item;
    Py_SET_SIZE(list, 0);
    while (n > 0) {
        Py_DECREF(items[--n]);
    }
}

static PyObject *
decode_lookups_into(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 5 || !PyList_CheckExact(args[4])) {
        PyErr_SetString(PyExc_TypeError, "decode_lookups_into(buf, generation, start, end, keys: list)");
        return NULL;
    }
    PyObject *keys[RUN_MAX];
    int32_t command;
    Py_ssize_t count = lookup_args(args, &command, keys);
    if (count < 0) {
        return NULL;
    }
    PyObject *list = args[4];
    empty_list(list);
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyList_Append(list, keys[i]) < 0) {
            release_keys(keys, i, count);
            return NULL;
        }
        Py_DECREF(keys[i]); /* the list holds it now */
    }
    return PyLong_FromLong(command);
}

static PyMethodDef methods[] = {
    {"decode_lookup", (PyCFunction)(void (*)(void))decode_lookup, METH_FASTCALL,
     "decode_lookup(buf, generation, offset=0) -> (command, key): see lmproto/_lookup_py.py."},
    {"decode_lookups", (PyCFunction)(void (*)(void))decode_lookups, METH_FASTCALL,
     "decode_lookups(buf, generation, start, end) -> (command, keys): see lmproto/_lookup_py.py."},
    {"decode_lookups_into", (PyCFunction)(void (*)(void))decode_lookups_into, METH_FASTCALL,
     "decode_lookups_into(buf, generation, start, end, keys) -> command: see lmproto/_lookup_py.py."},
    {NULL, NULL, 0, NULL},
};

static int
add_constants(PyObject *module)
{
    return PyModule_AddIntConstant(module, "RUN_MAX", RUN_MAX);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, add_constants},
    {0, NULL},
};

static struct PyModuleDef lookup_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmproto._lookup_c",
    .m_doc = "decode_lookup and decode_lookups compiled: the C twin of lmproto/_lookup_py.py.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__lookup_c(void)
{
    return PyModuleDef_Init(&lookup_module);
}
