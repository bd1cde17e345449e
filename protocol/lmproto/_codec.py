"""Header encoders and decoders for both frame generations. No I/O.

Strategy: decoders take any buffer (bytes, bytearray, memoryview) plus an offset and use
`struct.unpack_from`, so a server can parse many headers out of one receive buffer without
slicing copies. Encoders return the header alone; the caller sends the body beside it
(e.g. ``transport.writelines([header, memoryview(body)])``) so no KV blob is ever
concatenated.
"""

from __future__ import annotations

import struct

from ._constants import (
    DETECT_SIZE,
    INT32_MAX,
    KEY_SIZE,
    V0_REPLY,
    V0_REQUEST,
    V1_REPLY,
    V1_REQUEST,
    Command,
    Generation,
)
from ._errors import LocalProtocolError, RemoteProtocolError
from ._frames import NO_META, PLACEHOLDER_META, ObjectMeta, Reply, Request

_KNOWN_COMMANDS = frozenset(int(c) for c in Command)
_KEYLESS_COMMANDS = frozenset({Command.LIST, Command.HEALTH, Command.STATS, Command.EXIST_MANY})

# decode_request is the per-request cost of a pipelined burst, so it avoids Python-level
# NamedTuple construction: a v1 header's 28 metadata bytes are looked up in a bounded cache
# of decoded ObjectMeta (a connection repeats a handful of shapes), and a valid Request is
# built with tuple.__new__. Measured: 1.8 -> 1.0 us per v1 header here.
_V1_REQUEST_SPLIT = struct.Struct("<ii28s150s")  # command, length, metadata bytes, key
_V1_META = struct.Struct("<iiiiiii")  # fmt, dtype, location, shape[0..3]
_META_CACHE: dict[bytes, ObjectMeta] = {}
_META_CACHE_SIZE = 1024
_new_tuple = tuple.__new__

# ---------------------------------------------------------------------------------------
# keys


def encode_key(key: str) -> bytes:
    """The 150-byte key field for ``key``, padded with spaces as upstream's ``ljust`` does.

    Refuses keys that would not decode back to themselves: longer than 150 UTF-8 bytes,
    containing NUL, or with leading/trailing whitespace (upstream decoders ``strip()``).
    """
    if not isinstance(key, str):
        raise LocalProtocolError(f"key must be str, not {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates have no UTF-8 form
        raise LocalProtocolError("key is not encodable as UTF-8") from None
    if len(raw) > KEY_SIZE:
        raise LocalProtocolError(f"key is {len(raw)} UTF-8 bytes; the limit is {KEY_SIZE}")
    if "\x00" in key:
        raise LocalProtocolError("key contains NUL")
    if key != key.strip():
        raise LocalProtocolError("key has leading or trailing whitespace, which the wire strips")
    return raw.ljust(KEY_SIZE, b" ")


def validate_key(key: str) -> None:
    """Raise LocalProtocolError if ``key`` cannot be carried; see encode_key."""
    encode_key(key)


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


def encode_request(
    command: int,
    key: str = "",
    length: int = 0,
    *,
    generation: Generation = Generation.V0,
    meta: ObjectMeta = NO_META,
) -> bytes:
    """Request header bytes; ``length`` body bytes must follow it on the wire."""
    if not 0 <= length <= INT32_MAX:
        raise LocalProtocolError(f"body length {length} does not fit the int32 length field")
    field = encode_key(key)
    try:
        if generation == Generation.V0:
            return V0_REQUEST.pack(command, length, field)
        s0, s1, s2, s3 = _shape4(meta.shape)
        return V1_REQUEST.pack(command, length, meta.fmt, meta.dtype, meta.location, s0, s1, s2, s3, field)
    except struct.error as exc:  # command or a meta field is not an int32
        raise LocalProtocolError(f"request field does not fit int32: {exc}") from None


def decode_request(buf: bytes | bytearray | memoryview, generation: Generation, offset: int = 0) -> Request:
    """Decode one request header at ``offset``; the caller guarantees enough bytes.

    Raises RemoteProtocolError only for a negative length (the stream cannot be framed).
    Everything else that makes a request unservable lands in ``Request.problem``.
    """
    if generation == Generation.V0:
        command, length, raw = V0_REQUEST.unpack_from(buf, offset)
        meta = NO_META
    else:
        command, length, meta_bytes, raw = _V1_REQUEST_SPLIT.unpack_from(buf, offset)
        meta = _META_CACHE.get(meta_bytes)  # type: ignore[assignment]
        if meta is None:
            fmt, dtype, location, s0, s1, s2, s3 = _V1_META.unpack(meta_bytes)
            meta = ObjectMeta(fmt, dtype, (s0, s1, s2, s3), location)
            if len(_META_CACHE) < _META_CACHE_SIZE:
                _META_CACHE[meta_bytes] = meta
    if length < 0:
        raise RemoteProtocolError(f"negative body length {length} (command {command})")
    # Key: strip NUL padding, then whitespace on both ends as upstream's decoder does.
    try:
        key = raw.rstrip(b"\x00").decode("utf-8")
    except UnicodeDecodeError:
        return Request(command, length, "", meta, generation, "key is not valid UTF-8")
    if "\x00" in key:
        return Request(command, length, "", meta, generation, "key contains NUL")
    key = key.strip()
    if command not in _KNOWN_COMMANDS:
        return Request(command, length, key, meta, generation, f"unknown command {command}")
    if not key and command not in _KEYLESS_COMMANDS:
        return Request(command, length, key, meta, generation, "empty key")
    return _new_tuple(Request, (command, length, key, meta, generation, None))


# ---------------------------------------------------------------------------------------
# replies


def encode_reply(
    status: int,
    length: int = 0,
    *,
    generation: Generation = Generation.V0,
    meta: ObjectMeta = PLACEHOLDER_META,
) -> bytes:
    """Reply header bytes; ``length`` body bytes must follow it on the wire."""
    if not 0 <= length <= INT32_MAX:
        raise LocalProtocolError(f"body length {length} does not fit the int32 length field")
    try:
        if generation == Generation.V0:
            return V0_REPLY.pack(status, length)
        s0, s1, s2, s3 = _shape4(meta.shape)
        return V1_REPLY.pack(status, length, meta.fmt, meta.dtype, s0, s1, s2, s3, meta.location)
    except struct.error as exc:  # status or a meta field is not an int32
        raise LocalProtocolError(f"reply field does not fit int32: {exc}") from None


def decode_reply(buf: bytes | bytearray | memoryview, generation: Generation, offset: int = 0) -> Reply:
    """Decode one reply header at ``offset``; raises RemoteProtocolError on a negative length."""
    if generation == Generation.V0:
        status, length = V0_REPLY.unpack_from(buf, offset)
        meta = NO_META
    else:
        status, length, fmt, dtype, s0, s1, s2, s3, location = V1_REPLY.unpack_from(buf, offset)
        meta = ObjectMeta(fmt, dtype, (s0, s1, s2, s3), location)
    if length < 0:
        raise RemoteProtocolError(f"negative reply length {length} (status {status})")
    return Reply(status, length, meta, generation)


def _shape4(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    if len(shape) > 4:
        raise LocalProtocolError(f"shape has {len(shape)} dimensions; the wire carries at most 4")
    padded = tuple(shape) + (0,) * (4 - len(shape))
    for dim in padded:
        if not -(2**31) <= dim <= INT32_MAX:
            raise LocalProtocolError(f"shape dimension {dim} does not fit int32")
    return padded  # type: ignore[return-value]
