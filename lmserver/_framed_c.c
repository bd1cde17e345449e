/* send_nowait, recv_nowait and ReplyBuffer in C: the twins of _framed_py.py, which documents the
 * behaviour and is the reference (tests/test_framed_twins.py compares the two). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "_inplace.h" /* lmproto's buffers read in place: protocol/lmproto/_inplace.h */
#include "_keyscan.h" /* lmproto's key scan: protocol/lmproto/_keyscan.h */

#define FRAME_INTS 8 /* a reply frame's status and length, the two int32s it begins with (V0_REPLY) */

/* memcpy, clear of a trap in x86's string copy. glibc copies a few KiB and more with `rep movsb`,
 * which runs 10 to 30 times slower when the destination lies 1 to 31 bytes past the source
 * modulo 4 KiB (each load waits on a store whose address looks the same in its low 12 bits).
 * A GET reply walks straight into it: its 8-byte header goes first, so an object from a
 * page-aligned slot lands 8 bytes past where it lies (and in a pipelined burst of 4 KiB
 * replies, each next one 8 bytes further). There the copy runs backwards in 64-byte blocks,
 * so no load follows a store to its alias: 4 KiB in ~100 ns where `rep movsb` took ~1,240
 * (bench/PERFORMANCE.md, 2026-12-03). Copies below ALIAS_MIN take glibc's vector loop, which
 * does not stall so. */
#define ALIAS_MIN 2048
#define ALIAS_WINDOW 32

static inline void
copy_bytes(char *to, const char *from, size_t n)
{
#if defined(__SSE2__)
    size_t ahead = (size_t)((uintptr_t)to - (uintptr_t)from) & 4095;
    if (n > ALIAS_MIN && ahead != 0 && ahead < ALIAS_WINDOW) {
        size_t at = n;
        while (at >= 64) {
            at -= 64;
            __m128i d = _mm_loadu_si128((const __m128i *)(from + at + 48));
            __m128i c = _mm_loadu_si128((const __m128i *)(from + at + 32));
            __m128i b = _mm_loadu_si128((const __m128i *)(from + at + 16));
            __m128i a = _mm_loadu_si128((const __m128i *)(from + at));
            _mm_storeu_si128((__m128i *)(to + at + 48), d);
            _mm_storeu_si128((__m128i *)(to + at + 32), c);
            _mm_storeu_si128((__m128i *)(to + at + 16), b);
            _mm_storeu_si128((__m128i *)(to + at), a);
        }
        memcpy(to, from, at); /* the first n % 64 bytes: below any string-copy threshold */
        return;
    }
#endif
    memcpy(to, from, n);
}

/* The descriptor in `fd`, or -1 with TypeError or ValueError (as the Python twin). */
static int
fd_of(PyObject *fd)
{
    if (!PyLong_Check(fd)) {
        PyErr_Format(PyExc_TypeError, "fd must be an int, not %s", Py_TYPE(fd)->tp_name);
        return -1;
    }
    int overflow = 0;
    long value = PyLong_AsLongAndOverflow(fd, &overflow);
    if (overflow || value < 0 || value > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "fd must be in 0..%d, not %R", INT_MAX, fd);
        return -1;
    }
    return (int)value;
}

/* One send(2) of what fits; 0 if nothing could be sent, whatever the reason.
 * The GIL stays held: the socket is non-blocking, so send() never waits (uvloop's writes
 * run the same way). MSG_NOSIGNAL: a peer that is gone is an EPIPE, not a SIGPIPE. */
static ssize_t
send_all_it_takes(int fd, const void *data, Py_ssize_t length)
{
    ssize_t sent;
    do {
        sent = send(fd, data, (size_t)length, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    return sent < 0 ? 0 : sent;
}

static PyObject *
send_nowait(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send_nowait(fd, data)");
        return NULL;
    }
    int fd = fd_of(args[0]);
    if (fd < 0) {
        return NULL;
    }
    InPlace data;
    if (inplace_get(args[1], &data, 0) < 0) {
        return NULL;
    }
    ssize_t sent = send_all_it_takes(fd, data.buf, data.len);
    inplace_release(&data);
    return PyLong_FromSsize_t(sent);
}

/* One recv(2) into a writable buffer, the GIL held (the socket is non-blocking): the bytes
 * read, 0 at the peer's end of stream, -1 if nothing is there yet; OSError otherwise. */
static PyObject *
recv_nowait(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "recv_nowait(fd, buffer)");
        return NULL;
    }
    int fd = fd_of(args[0]);
    if (fd < 0) {
        return NULL;
    }
    InPlace into;
    if (inplace_get(args[1], &into, 1) < 0) {
        return NULL;
    }
    if (into.len == 0) {
        inplace_release(&into);
        PyErr_SetString(PyExc_ValueError, "recv_nowait into an empty buffer");
        return NULL;
    }
    ssize_t got;
    do {
        got = recv(fd, into.buf, (size_t)into.len, MSG_DONTWAIT);
    } while (got < 0 && errno == EINTR);
    inplace_release(&into);
    if (got < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            return PyLong_FromLong(-1);
        }
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t(got);
}

/* ReplyBuffer: the small replies of one turn, copied one after another into one growing
 * buffer of its own. Its memory is an anonymous mapping, as the staging buffers' (see
 * connection.py): taken at the first reply, grown with mremap, and given back to the OS by
 * release() when the connection goes quiet, not left as a hole in malloc's heap. */

#define MIN_CAPACITY 4096

typedef struct {
    PyObject_HEAD
    char *data;          /* NULL until the first reply, and after release() */
    Py_ssize_t length;   /* bytes queued: data[0:length] */
    Py_ssize_t capacity; /* bytes mapped */
} ReplyBuffer;

static PyObject *
buffer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwargs != NULL && PyDict_GET_SIZE(kwargs) != 0)) {
        PyErr_SetString(PyExc_TypeError, "ReplyBuffer() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0); /* zeroed: no memory until the first reply */
}

static void
buffer_unmap(ReplyBuffer *self)
{
    if (self->data != NULL) {
        munmap(self->data, (size_t)self->capacity);
    }
    self->data = NULL;
    self->length = self->capacity = 0;
}

static void
buffer_dealloc(ReplyBuffer *self)
{
    PyTypeObject *type = Py_TYPE(self);
    buffer_unmap(self);
    type->tp_free(self);
    Py_DECREF(type); /* a heap type */
}

/* Room for `more` bytes behind what is queued; -1 with MemoryError if it cannot be had. */
static int
buffer_reserve(ReplyBuffer *self, Py_ssize_t more)
{
    if (more <= self->capacity - self->length) {
        return 0;
    }
    if (more > PY_SSIZE_T_MAX / 2 - self->length) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t needed = self->length + more;
    Py_ssize_t capacity = self->capacity ? self->capacity : MIN_CAPACITY;
    while (capacity < needed) {
        capacity *= 2; /* stays a multiple of the page size */
    }
    void *data = self->data == NULL
                     ? mmap(NULL, (size_t)capacity, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                     : mremap(self->data, (size_t)self->capacity, (size_t)capacity, MREMAP_MAYMOVE);
    if (data == MAP_FAILED) {
        PyErr_NoMemory();
        return -1;
    }
    self->data = data;
    self->capacity = capacity;
    return 0;
}

static PyObject *
buffer_add(ReplyBuffer *self, PyObject *data)
{
    InPlace from;
    if (inplace_get(data, &from, 0) < 0) {
        return NULL;
    }
    int rc = buffer_reserve(self, from.len);
    if (rc == 0) {
        copy_bytes(self->data + self->length, from.buf, (size_t)from.len);
        self->length += from.len;
    }
    inplace_release(&from);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE; /* not the length: a new int per 4 KiB reply, for a caller that has len() */
}

static PyObject *
buffer_add_framed(ReplyBuffer *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "add_framed(header, buffer)");
        return NULL;
    }
    PyObject *header = args[0];
    if (!PyBytes_Check(header)) {
        PyErr_Format(PyExc_TypeError, "header must be bytes, not %s", Py_TYPE(header)->tp_name);
        return NULL;
    }
    Py_ssize_t head = PyBytes_GET_SIZE(header);
    if (head < FRAME_INTS) {
        PyErr_Format(PyExc_ValueError, "header must hold a status and a length (8 bytes), not %zd bytes", head);
        return NULL;
    }
    InPlace body;
    if (inplace_get(args[1], &body, 0) < 0) {
        return NULL;
    }
    /* The length the header announces: no int object to pass it in and read back per reply. */
    int32_t length = read_i32_le((const unsigned char *)PyBytes_AS_STRING(header) + 4);
    int rc = -1;
    if (length < 0 || length > body.len) {
        PyErr_Format(PyExc_ValueError, "the header's length must be in 0..%zd, not %d", body.len, (int)length);
    }
    else {
        rc = buffer_reserve(self, head + length); /* no overflow: both are sizes of objects */
        if (rc == 0) {
            memcpy(self->data + self->length, PyBytes_AS_STRING(header), (size_t)head);
            copy_bytes(self->data + self->length + head, body.buf, (size_t)length);
            self->length += head + length;
        }
    }
    inplace_release(&body);
    if (rc < 0) {
        return NULL;
    }
    Py_RETURN_NONE; /* not the length: a new int per 4 KiB reply, for a caller that has len() */
}

/* (a, b) as a new tuple of ints. Not Py_BuildValue("(nn)"): it parses its format on every
 * call (~450 instructions, a third of a sequential EXIST's add_exists). */
static PyObject *
two_counts(Py_ssize_t a, Py_ssize_t b)
{
    PyObject *first = PyLong_FromSsize_t(a);
    PyObject *second = first == NULL ? NULL : PyLong_FromSsize_t(b);
    PyObject *result = second == NULL ? NULL : PyTuple_Pack(2, first, second);
    Py_XDECREF(first); /* the tuple holds its own references */
    Py_XDECREF(second);
    return result;
}

/* One EXIST of the run: 1 (hit) or 0 (miss) for the key in field[0:KEY_SIZE], 2 if the
 * field holds no key the scan takes (the run ends), -1 with an exception. */
static int
exist_in(PyObject *shards, const unsigned char *field)
{
    PyObject *key = ascii_key(field);
    if (key == NULL) {
        return -1;
    }
    if (PyUnicode_GET_LENGTH(key) == 0) {
        Py_DECREF(key);
        return 2;
    }
    Py_hash_t hash = PyObject_Hash(key); /* cached on the str: the dict lookup reuses it */
    Py_ssize_t count = PyTuple_GET_SIZE(shards);
    Py_ssize_t index = hash % count; /* shard_index: C rounds toward zero, Python's % does not */
    PyObject *shard = PyTuple_GET_ITEM(shards, index < 0 ? index + count : index);
    int found = -1;
    if (!PyDict_Check(shard)) {
        PyErr_Format(PyExc_TypeError, "shards must be a tuple of dicts, not of %s", Py_TYPE(shard)->tp_name);
    }
    else {
        found = PyDict_Contains(shard, key);
    }
    Py_DECREF(key);
    return found;
}

static PyObject *
buffer_add_exists(ReplyBuffer *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "add_exists(buf, generation, start, end, shards, replies, stop_at_miss)");
        return NULL;
    }
    PyObject *shards = args[4], *replies = args[5];
    if (!PyTuple_Check(shards)) {
        PyErr_Format(PyExc_TypeError, "shards must be a tuple of dicts, not %s", Py_TYPE(shards)->tp_name);
        return NULL;
    }
    if (PyTuple_GET_SIZE(shards) == 0) {
        PyErr_SetString(PyExc_ValueError, "shards must not be empty");
        return NULL;
    }
    if (!PyTuple_Check(replies) || PyTuple_GET_SIZE(replies) != 2 || !PyBytes_CheckExact(PyTuple_GET_ITEM(replies, 0))
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(replies, 1))) {
        PyErr_SetString(PyExc_TypeError, "replies must be a tuple of two bytes: (miss, hit)");
        return NULL;
    }
    Py_ssize_t key_at = key_offset(args[1]);
    Py_ssize_t start, end;
    if (key_at < 0 || read_index(args[2], &start) < 0 || read_index(args[3], &end) < 0) {
        return NULL;
    }
    int stop_at_miss = PyObject_IsTrue(args[6]);
    if (stop_at_miss < 0) {
        return NULL;
    }
    /* An export, not inplace_get: the shard lookups below may run Python code (a key's
     * __eq__), which must not be able to release or resize the buffer being scanned. */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    Py_ssize_t size = key_at + KEY_SIZE;
    if (start < 0 || end > view.len || end - start < size) {
        PyBuffer_Release(&view);
        return no_header();
    }
    const unsigned char *buf = view.buf;
    Py_ssize_t queued = self->length, answered = 0, hits = 0;
    for (Py_ssize_t at = start; end - at >= size; at += size) {
        if (read_i32_le(buf + at) != EXIST || read_i32_le(buf + at + 4) != 0) {
            break; /* another command, or a body follows */
        }
        int found = exist_in(shards, buf + at + key_at);
        if (found < 0) {
            goto fail;
        }
        if (found == 2 || (found == 0 && stop_at_miss)) {
            break;
        }
        PyObject *reply = PyTuple_GET_ITEM(replies, found);
        Py_ssize_t length = PyBytes_GET_SIZE(reply);
        if (buffer_reserve(self, length) < 0) {
            goto fail;
        }
        memcpy(self->data + self->length, PyBytes_AS_STRING(reply), (size_t)length);
        self->length += length;
        answered++;
        hits += found;
    }
    PyBuffer_Release(&view);
    return two_counts(answered, hits);
fail:
    self->length = queued; /* nothing half-way: the caller answers none of the run */
    PyBuffer_Release(&view);
    return NULL;
}

static PyObject *
buffer_send(ReplyBuffer *self, PyObject *fd_object)
{
    int fd = fd_of(fd_object);
    if (fd < 0) {
        return NULL;
    }
    ssize_t sent = send_all_it_takes(fd, self->data, self->length);
    if (sent > 0) {
        /* What the socket did not take moves to the front (the rare partial send). */
        memmove(self->data, self->data + sent, (size_t)(self->length - sent));
        self->length -= sent;
    }
    return PyLong_FromSsize_t(self->length); /* what is left: 0, a cached int, as a rule */
}

static PyObject *
buffer_take(ReplyBuffer *self, PyObject *unused)
{
    (void)unused;
    PyObject *taken = PyBytes_FromStringAndSize(self->data, self->length);
    if (taken != NULL) {
        self->length = 0;
    }
    return taken;
}

static PyObject *
buffer_release(ReplyBuffer *self, PyObject *unused)
{
    (void)unused;
    buffer_unmap(self);
    Py_RETURN_NONE;
}

static PyObject *
buffer_sizeof(ReplyBuffer *self, PyObject *unused)
{
    (void)unused;
    return PyLong_FromSsize_t((Py_ssize_t)sizeof(ReplyBuffer) + self->capacity);
}

static Py_ssize_t
buffer_length(ReplyBuffer *self)
{
    return self->length;
}

static PyMethodDef buffer_methods[] = {
    {"add", (PyCFunction)buffer_add, METH_O, "add(data): data copied behind what is queued."},
    {"add_framed", (PyCFunction)(void (*)(void))buffer_add_framed, METH_FASTCALL,
     "add_framed(header, buffer): a reply frame, header + the body it announces from buffer, queued."},
    {"add_exists", (PyCFunction)(void (*)(void))buffer_add_exists, METH_FASTCALL,
     "add_exists(buf, generation, start, end, shards, replies, stop_at_miss) -> (answered, hits): "
     "see lmserver/_framed_py.py."},
    {"send", (PyCFunction)buffer_send, METH_O,
     "send(fd) -> bytes still queued after one send(2) of them (0: all sent)."},
    {"take", (PyCFunction)buffer_take, METH_NOARGS, "take() -> everything queued, as bytes; empties it."},
    {"release", (PyCFunction)buffer_release, METH_NOARGS, "Drop what is queued and free the memory."},
    {"__sizeof__", (PyCFunction)buffer_sizeof, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot buffer_slots[] = {
    {Py_tp_new, buffer_new},
    {Py_tp_dealloc, buffer_dealloc},
    {Py_tp_methods, buffer_methods},
    {Py_sq_length, buffer_length},
    {Py_tp_doc, "ReplyBuffer() -> an empty buffer of replies: see lmserver/_framed_py.py."},
    {0, NULL},
};

static PyType_Spec buffer_spec = {
    .name = "lmserver._framed_c.ReplyBuffer",
    .basicsize = sizeof(ReplyBuffer),
    .flags = Py_TPFLAGS_DEFAULT,
    .slots = buffer_slots,
};

static PyMethodDef methods[] = {
    {"send_nowait", (PyCFunction)(void (*)(void))send_nowait, METH_FASTCALL,
     "send_nowait(fd, data) -> bytes sent with one send(2), 0 if none: see lmserver/_framed_py.py."},
    {"recv_nowait", (PyCFunction)(void (*)(void))recv_nowait, METH_FASTCALL,
     "recv_nowait(fd, buffer) -> bytes read with one recv(2), 0 at EOF, -1 if none yet: see "
     "lmserver/_framed_py.py."},
    {NULL, NULL, 0, NULL},
};

static int
add_types(PyObject *module)
{
    PyObject *type = PyType_FromSpec(&buffer_spec);
    if (type == NULL) {
        return -1;
    }
    int rc = PyModule_AddObjectRef(module, "ReplyBuffer", type);
    Py_DECREF(type);
    return rc;
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, add_types},
    {0, NULL},
};

static struct PyModuleDef framed_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "lmserver._framed_c",
    .m_doc = "send_nowait, recv_nowait and ReplyBuffer compiled: the C twins of lmserver/_framed_py.py.",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = slots,
};

PyMODINIT_FUNC
PyInit__framed_c(void)
{
    return PyModuleDef_Init(&framed_module);
}
