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
_KEYLESS_COMMANDS: Final = frozenset({Command.LIST, Command.HEALTH, Command.STATS, Command.EXIST_MANY})

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
        command, length, raw = _unpack_v0_request(buf, offset)
        meta = _NO_META
    else:
        command, length, meta_bytes, raw = _unpack_v1_request(buf, offset)
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
    # Key: strip NUL padding, then whitespace on both ends as upstream's decoder does. Clients
    # pad with spaces (upstream's ljust), so trailing ASCII whitespace goes first, as bytes
    # (bytes.rstrip() without an argument: a tight loop, unlike with one): str.strip would
    # remove it anyway, and no byte of a multi-byte UTF-8 character is ASCII. The decoded key
    # needs str.strip, which scans all of it, only if an end byte may still be whitespace.
    key_bytes = raw.rstrip(b"\x00") if raw[-1] == 0 else raw
    if key_bytes and key_bytes[-1] <= 0x20:
        key_bytes = key_bytes.rstrip()
    try:
        key = key_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return Request(command, length, "", meta, generation, "key is not valid UTF-8")
    if "\x00" in key:
        return Request(command, length, "", meta, generation, "key contains NUL")
    if key_bytes and (_maybe_space(key_bytes[0]) or _maybe_space(key_bytes[-1])):
        key = key.strip()
    if command not in _KNOWN_COMMANDS:
        return Request(command, length, key, meta, generation, f"unknown command {command}")
    if not key and command not in _KEYLESS_COMMANDS:
        return Request(command, length, key, meta, generation, "empty key")
    return _new_tuple(_REQUEST, (command, length, key, meta, generation, None))


def _maybe_space(byte: int) -> bool:
    """Whether the character a key's first or last UTF-8 byte belongs to may be whitespace
    (``str.strip`` removes it): every whitespace character is at most U+0020 or above U+007E,
    so a key that starts and ends with printable ASCII needs no strip."""
    return byte <= 0x20 or byte > 0x7E


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
