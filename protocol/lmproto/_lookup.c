/* decode_lookup in C: the twin of _lookup.py, which documents the behaviour and is the
 * reference (a test compares the two on every kind of header). Read that file first.
 *
 * For an ASCII key field, the key rule of SPEC.md section 5 (drop trailing NUL padding,
 * refuse a NUL left inside, strip whitespace at both ends) is a scan of at most 150 bytes
 * in place: no bytes object for the field, no decode, no str.strip walking the padding. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define KEY_SIZE 150
#define V0_KEY_AT 8  /* command, length */
#define V1_KEY_AT 36 /* command, length, 7 metadata ints */

/* The ASCII characters str.isspace() accepts, so that the scan strips what str.strip() does. */
static int
is_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static int32_t
read_i32_le(const unsigned char *p)
{
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* Eight bytes at a time: the field is mostly padding (LMCache pads a ~40-byte key with
 * spaces, struct.pack with NULs), and a byte loop over it was a quarter of a lookup. */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

static uint64_t
load8(const unsigned char *p)
{
    uint64_t word;
    memcpy(&word, p, sizeof word);
    return word;
}

/* memcpy for at most KEY_SIZE bytes: a plain memcpy of a run-time length compiles to
 * `rep movsq` here, whose start-up cost was a third of a lookup. */
static void
copy_short(unsigned char *to, const unsigned char *from, Py_ssize_t n)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t word = load8(from + i);
        memcpy(to + i, &word, sizeof word);
    }
    for (; i < n; i++) {
        to[i] = from[i];
    }
}

/* How many of a word's last bytes (in memory order) are zero: its top bytes as a little-endian
 * integer. Where the compiler or byte order is unknown, drop_trailing counts them bytewise. */
#if defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
#define LAST_ZERO_BYTES(word) (__builtin_clzll(word) >> 3)
#elif defined(__GNUC__) && defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
#define LAST_ZERO_BYTES(word) (__builtin_ctzll(word) >> 3)
#endif

/* Where field[0:end] ends once trailing `pad` bytes are dropped: whole words of padding, then
 * the padding at the end of the first word that is not all padding (XOR with the padding
 * leaves zero bytes exactly where the pad bytes are). */
static Py_ssize_t
drop_trailing(const unsigned char *field, Py_ssize_t end, unsigned char pad)
{
    const uint64_t padding = ONES * pad;
    while (end >= 8) {
        uint64_t differs = load8(field + end - 8) ^ padding;
        if (differs) {
#ifdef LAST_ZERO_BYTES
            return end - LAST_ZERO_BYTES(differs);
#else
            break;
#endif
        }
        end -= 8;
    }
    while (end > 0 && field[end - 1] == pad) {
        end--;
    }
    return end;
}

/* Whether field[0:end] holds a NUL or a byte >= 0x80. Per word: a byte >= 0x80 sets its high
 * bit in `word`, a zero byte borrows into its high bit in `word - ONES`; a borrow into a byte
 * that is neither comes only from a zero byte below it, which is a hit anyway. */
static int
nul_or_not_ascii(const unsigned char *field, Py_ssize_t end)
{
    Py_ssize_t i = 0;
    for (; i + 8 <= end; i += 8) {
        uint64_t word = load8(field + i);
        if (((word - ONES) | word) & HIGHS) {
            return 1;
        }
    }
    for (; i < end; i++) {
        if (field[i] == 0 || field[i] >= 0x80) {
            return 1;
        }
    }
    return 0;
}

/* The key in field[0:KEY_SIZE] as a new str, or a new reference to "" when the field is not
 * all ASCII, breaks the rule or holds an empty key. NULL with an exception on failure. */
static PyObject *
ascii_key(const unsigned char *field)
{
    /* Trailing spaces are dropped before the check, not after as the rule reads: they are
     * neither NUL nor non-ASCII, so the verdict is the same, and LMCache's space padding is
     * then skipped by words once instead of checked by words and then skipped. */
    Py_ssize_t end = drop_trailing(field, drop_trailing(field, KEY_SIZE, 0), ' ');
    if (nul_or_not_ascii(field, end)) { /* a NUL inside, or not ASCII */
        return PyUnicode_New(0, 0);
    }
    while (end > 0 && is_space(field[end - 1])) {
        end--;
    }
    Py_ssize_t start = 0;
    while (start < end && is_space(field[start])) {
        start++;
    }
    PyObject *key = PyUnicode_New(end - start, 127);
    if (key != NULL) {
        copy_short((unsigned char *)PyUnicode_DATA(key), field + start, end - start);
    }
    return key;
}

#define GET 2   /* Command.GET */
#define EXIST 3 /* Command.EXIST */
#define RUN_MAX 64 /* keys per decode_lookups call: the _lookup.py twin's RUN_MAX */

static PyObject *
no_header(void)
{
    PyErr_SetString(PyExc_ValueError, "the buffer holds no whole request header at this offset");
    return NULL;
}

/* Where the key field starts in a header of `generation` (0 or 1), or -1 with ValueError. */
static Py_ssize_t
key_offset(PyObject *generation)
{
    long number = PyLong_Check(generation) ? PyLong_AsLong(generation) : -1;
    if (number != 0 && number != 1) {
        PyErr_Clear(); /* an overflow reads as -1 with an OverflowError set */
        PyErr_Format(PyExc_ValueError, "generation must be 0 or 1, not %R", generation);
        return -1;
    }
    return number ? V1_KEY_AT : V0_KEY_AT;
}

/* An index argument into *out: 0, or -1 with TypeError for a non-int, or ValueError (no
 * whole header there) for one too large for a Py_ssize_t, as the Python twin says. */
static int
read_index(PyObject *number, Py_ssize_t *out)
{
    *out = PyLong_AsSsize_t(number);
    if (*out == -1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return -1; /* not an int: TypeError, as the Python twin */
        }
        PyErr_Clear();
        no_header();
        return -1;
    }
    return 0;
}

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
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (offset < 0 || view.len - offset < key_at + KEY_SIZE) {
        PyBuffer_Release(&view);
        return no_header();
    }
    const unsigned char *header = (const unsigned char *)view.buf + offset;
    int32_t command = read_i32_le(header);
    int32_t length = read_i32_le(header + 4);
    PyObject *key = length ? PyUnicode_New(0, 0) : ascii_key(header + key_at);
    PyBuffer_Release(&view);
    return pair(command, key);
}

/* The keys of the run of lookups at buf[start:end] as a new tuple (at most RUN_MAX of them),
 * the command of the first header into *command; NULL with an exception on failure. The keys
 * are collected first, so the tuple is made once at its size (no list growing key by key). */
static PyObject *
lookup_run(const unsigned char *buf, Py_ssize_t start, Py_ssize_t end, Py_ssize_t key_at, int32_t *command)
{
    PyObject *keys[RUN_MAX];
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
                goto fail;
            }
            if (PyUnicode_GET_LENGTH(key) == 0) {
                Py_DECREF(key);
                break; /* a key this scan does not take: decode_request's */
            }
            keys[count++] = key;
        }
    }
    PyObject *run = PyTuple_New(count);
    if (run == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyTuple_SET_ITEM(run, i, keys[i]); /* steals the reference */
    }
    return run;
fail:
    while (count > 0) {
        Py_DECREF(keys[--count]);
    }
    return NULL;
}

static PyObject *
decode_lookups(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "decode_lookups(buf, generation, start, end)");
        return NULL;
    }
    Py_ssize_t key_at = key_offset(args[1]);
    Py_ssize_t start, end;
    if (key_at < 0 || read_index(args[2], &start) < 0 || read_index(args[3], &end) < 0) {
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (start < 0 || end > view.len || end - start < key_at + KEY_SIZE) {
        PyBuffer_Release(&view);
        return no_header();
    }
    int32_t command;
    PyObject *keys = lookup_run((const unsigned char *)view.buf, start, end, key_at, &command);
    PyBuffer_Release(&view);
    return pair(command, keys);
}

static PyMethodDef methods[] = {
    {"decode_lookup", (PyCFunction)(void (*)(void))decode_lookup, METH_FASTCALL,
     "decode_lookup(buf, generation, offset=0) -> (command, key): see lmproto/_lookup.py."},
    {"decode_lookups", (PyCFunction)(void (*)(void))decode_lookups, METH_FASTCALL,
     "decode_lookups(buf, generation, start, end) -> (command, keys): see lmproto/_lookup.py."},
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
    .m_name = "lmproto._lookup",
    .m_doc = "decode_lookup and decode_lookups compiled: the C twin of lmproto/_lookup.py.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__lookup(void)
{
    return PyModuleDef_Init(&lookup_module);
}
