/* The key scan of a request header, shared by the C twins that read keys in place:
 * lmproto/_lookup_c.c (decode_lookup, decode_lookups) and lmserver/_framed_c.c
 * (ReplyBuffer.add_exists). One copy, so that both take exactly the keys the rule of SPEC.md
 * section 5 gives; lmproto/_lookup_py.py is the reference. Include after <Python.h>.
 *
 * For an ASCII key field, the rule (drop trailing NUL padding, refuse a NUL left inside,
 * strip whitespace at both ends) is a scan of at most 150 bytes in place: no bytes object
 * for the field, no decode, no str.strip walking the padding. */

#ifndef LMPROTO_KEYSCAN_H
#define LMPROTO_KEYSCAN_H

#include <stdint.h>
#include <string.h>

#define KEY_SIZE 150
#define V0_KEY_AT 8  /* command, length */
#define V1_KEY_AT 36 /* command, length, 7 metadata ints */

/* The ASCII characters str.isspace() accepts, so that the scan strips what str.strip() does. */
static inline int
is_space(unsigned char c)
{
    return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f);
}

static inline int32_t
read_i32_le(const unsigned char *p)
{
    return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

/* Eight bytes at a time: the field is mostly padding (LMCache pads a ~40-byte key with
 * spaces, struct.pack with NULs), and a byte loop over it was a quarter of a lookup. */
#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

static inline uint64_t
load8(const unsigned char *p)
{
    uint64_t word;
    memcpy(&word, p, sizeof word);
    return word;
}

/* memcpy for at most KEY_SIZE bytes: a plain memcpy of a run-time length compiles to
 * `rep movsq` here, whose start-up cost was a third of a lookup. */
static inline void
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
static inline Py_ssize_t
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
static inline int
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
static inline PyObject *
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

static inline PyObject *
no_header(void)
{
    PyErr_SetString(PyExc_ValueError, "the buffer holds no whole request header at this offset");
    return NULL;
}

/* Where the key field starts in a header of `generation` (0 or 1), or -1 with ValueError. */
static inline Py_ssize_t
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
static inline int
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

#endif /* LMPROTO_KEYSCAN_H */
