"""Header decoders for both frame generations: the server's per-request work. No I/O.

Strategy: decoders take any buffer (bytes, bytearray, memoryview) plus an offset and use
`struct.unpack_from`, so a server can parse many headers out of one receive buffer without
slicing copies.

Compiled by mypyc when the build can (setup.py, lmproto/_native.py); the source stays the
reference and runs as is everywhere else. Split from _codec.py (the encoders) for that reason:
the encoders check arbitrary arguments themselves, these take only what they are typed for.
"""

from __future__ import annotations

import struct
from typing import Final

from ._constants import DETECT_SIZE, V0_REPLY, V0_REQUEST, V1_REPLY, Command, Generation
from ._errors import RemoteProtocolError
from ._frames import NO_META, ObjectMeta, Reply, Request

_KNOWN_COMMANDS: Final = frozenset(int(c) for c in Command)
_KEYLESS_COMMANDS: Final = frozenset(
    {Command.LIST, Command.HEALTH, Command.STATS, Command.EXIST_MANY, Command.DELETE_MANY, Command.LIST_PAGE}
)

# decode_request is the per-request cost of a pipelined burst, so it avoids Python-level
# NamedTuple construction: a v1 header's 28 metadata bytes are looked up in a bounded cache
# of decoded ObjectMeta (a connection repeats a handful of shapes), and a valid Request is
# built with tuple.__new__. Measured: 1.8 -> 1.0 us per v1 header here.
_V1_REQUEST_SPLIT: Final = struct.Struct("<ii28s150s")  # command, length, metadata bytes, key
_V1_META: Final = struct.Struct("<iiiiiii")  # fmt, dtype, location, shape[0..3]
_META_CACHE: Final[dict[bytes, ObjectMeta]] = {}
_META_CACHE_SIZE: Final = 1024
_new_tuple: Final = tuple.__new__
# Compiled (mypyc), a module-level name is looked up in the module's dict on every use unless
# it is Final (then it is a C static): the names decode_request uses are all Final here,
# imported ones through these aliases, and methods are bound once.
_V0: Final = Generation.V0
_NO_META: Final = NO_META
_REQUEST: Final = Request
_unpack_v0_request: Final = V0_REQUEST.unpack_from
_unpack_v1_request: Final = _V1_REQUEST_SPLIT.unpack_from

# ---------------------------------------------------------------------------------------
# generation detection


def detect_generation(buf: bytes | bytearray | memoryview, offset: int = 0) -> Generation | None:
    """Which generation a connection speaks, from the first bytes of its first header.

    Bytes 8..11 are the v1 ``fmt`` field (a small integer, so bytes 9..11 are NUL) but key
    text in v0, which never holds NUL there. Returns None until 12 bytes are available.

    One v0 case reads as v1: a client that pads with NUL (upstream pads with spaces) and
    sends a key of at most one byte, e.g. an empty LIST key, on its first request. Servers
    facing such clients are configured for v0 instead of detecting.
    """
    if len(buf) - offset < DETECT_SIZE:
        return None
    if buf[offset + 9] == 0 and buf[offset + 10] == 0 and buf[offset + 11] == 0:
        return Generation.V1
    return Generation.V0


# ---------------------------------------------------------------------------------------
# requests


def decode_request(buf: bytes | bytearray | memoryview, generation: Generation, offset: int = 0) -> Request:
    """Decode one request header at ``offset``; the caller guarantees enough bytes.

    Raises RemoteProtocolError only for a negative length (the stream cannot be framed).
    Everything else that makes a request unservable lands in ``Request.problem``.
    """
    if generation is _V0:
        v0_fields: tuple[int, int, bytes] = _unpack_v0_request(buf, offset)
        command, length, raw = v0_fields
        meta = _NO_META
    else:
        v1_fields: tuple[int, int, bytes, bytes] = _unpack_v1_request(buf, offset)
        command, length, meta_bytes, raw = v1_fields
        # Not `meta = _META_CACHE.get(...)` under a type: ignore: compiled (mypyc), ``meta`` is
        # checked to be an ObjectMeta on assignment, and None would raise TypeError.
        cached = _META_CACHE.get(meta_bytes)
        if cached is None:
            fmt, dtype, location, s0, s1, s2, s3 = _V1_META.unpack(meta_bytes)
            meta = ObjectMeta(fmt, dtype, (s0, s1, s2, s3), location)
            if len(_META_CACHE) < _META_CACHE_SIZE:
                _META_CACHE[meta_bytes] = meta
        else:
            meta = cached
    if length < 0:
        raise RemoteProtocolError(f"negative body length {length} (command {command})")
    key, problem = _decode_key(raw)
    if problem:
        return Request(command, length, "", meta, generation, problem)
    if command not in _KNOWN_COMMANDS:
        return Request(command, length, key, meta, generation, f"unknown command {command}")
    if not key and command not in _KEYLESS_COMMANDS:
        return Request(command, length, key, meta, generation, "empty key")
    return _new_tuple(_REQUEST, (command, length, key, meta, generation, None))


def _decode_key(raw: bytes) -> tuple[str, str]:
    """``(key, "")`` or ``("", problem)``: the key rule of SPEC.md section 5 for a key field.

    The rule drops trailing NUL padding, decodes strict UTF-8, refuses a NUL left inside and
    strips whitespace on both ends. Here the whole field is decoded first, which accepts and
    refuses the same fields (a NUL is one byte and one character in UTF-8), because every step
    after it is then a str operation that mypyc compiles to a direct C call: no method lookup.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "", "key is not valid UTF-8"
    text = text.rstrip("\x00")
    if "\x00" in text:
        return "", "key contains NUL"
    return text.strip(), ""


# ---------------------------------------------------------------------------------------
# replies


def decode_reply(buf: bytes | bytearray | memoryview, generation: Generation, offset: int = 0) -> Reply:
    """Decode one reply header at ``offset``; raises RemoteProtocolError on a negative length."""
    if generation is _V0:
        status, length = V0_REPLY.unpack_from(buf, offset)
        meta = _NO_META
    else:
        status, length, fmt, dtype, s0, s1, s2, s3, location = V1_REPLY.unpack_from(buf, offset)
        meta = ObjectMeta(fmt, dtype, (s0, s1, s2, s3), location)
    if length < 0:
        raise RemoteProtocolError(f"negative reply length {length} (status {status})")
    return Reply(status, length, meta, generation)
