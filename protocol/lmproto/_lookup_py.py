"""``decode_lookup``, ``decode_lookups`` and ``decode_lookups_into``: command and key of
bodiless request headers, the server's fast path.

Strategy: two twins with one behaviour. ``_lookup_c.c`` is the one a build compiles and the
selector ``_lookup.py`` imports when it is there (docs/building.md); this file is the reference,
and what runs in a pure install or with ``LMSERVER_PURE=1``. tests/test_lookup_twins.py feeds
both the same headers and compares every answer and every error.

Why C and not mypyc: after mypyc, finding the key in its 150-byte field was the largest share
of a pipelined lookup's CPU (``struct`` unpacking, a bytes object for the field, a str decode,
``rstrip`` and ``strip`` walking the padding one character at a time). The C twin reads the
two integers and scans the field in place, and builds only the key's str.

Only fields that are all ASCII are decoded here: anything else (a UTF-8 key, which is legal
but which LMCache never sends) answers ``""`` and the caller decodes the header with
``decode_request``, which applies the whole key rule. That keeps the C twin small: for ASCII,
the rule of SPEC.md section 5 is a byte scan.
"""

from __future__ import annotations

import struct
from typing import Final

from ._constants import KEY_SIZE, V0_REQUEST, Command, Generation
from ._decode import _decode_key

_KEY_AT: Final = (V0_REQUEST.size - KEY_SIZE, struct.calcsize("<ii28x"))  # by generation
_unpack_v0: Final = V0_REQUEST.unpack_from
_unpack_v1: Final = struct.Struct("<ii28x150s").unpack_from  # metadata skipped as pad bytes
_LOOKUPS: Final = (Command.EXIST, Command.GET)

RUN_MAX: Final = 64
"""The most keys one ``decode_lookups`` call returns (the C twin collects them on its stack).
A longer burst takes a call per 64 headers, still a small share of serving them."""


def decode_lookup(
    buf: bytes | bytearray | memoryview, generation: Generation, offset: int = 0
) -> tuple[int, str]:
    """``(command, key)`` of the request header at ``offset``, if it has no body and its key
    field is ASCII and holds a valid, non-empty key; else ``(command, "")``, and the caller
    must decode the header with ``decode_request``.

    EXIST and GET need nothing else, so the server builds no Request for them. ``buf`` is a
    buffer of bytes (bytes, bytearray, mmap, a byte memoryview); ``generation`` is 0 or 1.
    Raises ValueError for any other generation, a negative offset or too few bytes.
    """
    if generation != 0 and generation != 1:
        raise ValueError(f"generation must be 0 or 1, not {generation!r}")
    if offset < 0 or len(buf) - offset < _KEY_AT[generation] + KEY_SIZE:
        raise ValueError("the buffer holds no whole request header at this offset")
    fields: tuple[int, int, bytes] = (_unpack_v1 if generation else _unpack_v0)(buf, offset)
    command, length, raw = fields
    if length or not raw.isascii():
        return command, ""
    return command, _decode_key(raw)[0]


def decode_lookups(
    buf: bytes | bytearray | memoryview, generation: Generation, start: int, end: int
) -> tuple[int, tuple[str, ...]]:
    """The run of lookups that begins at ``start``: ``(command, keys)``.

    ``command`` is the command of the header at ``start``. If it is EXIST or GET, ``keys`` are
    the keys of that header and of those after it, up to ``end``, for as long as
    ``decode_lookup`` answers each with that same command and a non-empty key; the run ends
    at any other header, where a whole header no longer fits before ``end``, or after
    ``RUN_MAX`` keys. Otherwise, or if the first header's key is not one ``decode_lookup``
    takes, ``keys`` is empty and the caller decodes that header with ``decode_request``.

    One call for a pipelined burst of lookups instead of one per header: the server's way
    in. Raises ValueError for a generation other than 0 and 1, and unless
    ``0 <= start``, ``start`` + one header ``<= end <= len(buf)``.
    """
    if generation != 0 and generation != 1:
        raise ValueError(f"generation must be 0 or 1, not {generation!r}")
    size = _KEY_AT[generation] + KEY_SIZE
    if start < 0 or end > len(buf) or end - start < size:
        raise ValueError("the buffer holds no whole request header at this offset")
    command, key = decode_lookup(buf, generation, start)  # each header decoded once
    keys: list[str] = []
    at = start
    while key and command in _LOOKUPS:
        keys.append(key)
        at += size
        if len(keys) == RUN_MAX or end - at < size:
            break
        each, key = decode_lookup(buf, generation, at)
        if each != command:
            break
    return command, tuple(keys)


def decode_lookups_into(
    buf: bytes | bytearray | memoryview, generation: Generation, start: int, end: int, keys: list[str]
) -> int:
    """``decode_lookups``, the keys put in place of what ``keys`` held: returns the command.

    The server's form. It keeps one list per connection, so a lookup makes no tuple and no
    list: in C, making and freeing ``decode_lookups``' two tuples took ~340 of a sequential
    GET's ~7,430 instructions (``python -m bench.instructions --servers``). The C twin keeps
    the list's allocation from call to call.

    Raises as ``decode_lookups`` does, leaving ``keys`` as it was, and TypeError if ``keys``
    is not exactly a list.
    """
    if type(keys) is not list:
        raise TypeError("decode_lookups_into(buf, generation, start, end, keys: list)")
    command, run = decode_lookups(buf, generation, start, end)
    keys[:] = run
    return command
