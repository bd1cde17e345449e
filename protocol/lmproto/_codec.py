"""Header encoders for both frame generations. No I/O. The decoders are in _decode.py.

Strategy: encoders return the header alone; the caller sends the body beside it
(e.g. ``transport.writelines([header, memoryview(body)])``) so no KV blob is ever
concatenated.

Not compiled by mypyc (setup.py), unlike _decode.py: the encoders check what any caller hands
them (a non-str key, a shape of 5 dimensions) and answer LocalProtocolError, where compiled
code would raise TypeError at the call, before those checks run.
"""

from __future__ import annotations

import struct

from ._constants import (
    INT32_MAX,
    KEY_SIZE,
    V0_REPLY,
    V0_REQUEST,
    V1_REPLY,
    V1_REQUEST,
    Generation,
)
from ._errors import LocalProtocolError
from ._frames import NO_META, PLACEHOLDER_META, ObjectMeta

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


def _shape4(shape: tuple[int, ...]) -> tuple[int, int, int, int]:
    if len(shape) > 4:
        raise LocalProtocolError(f"shape has {len(shape)} dimensions; the wire carries at most 4")
    padded = tuple(shape) + (0,) * (4 - len(shape))
    for dim in padded:
        if not -(2**31) <= dim <= INT32_MAX:
            raise LocalProtocolError(f"shape dimension {dim} does not fit int32")
    return padded  # type: ignore[return-value]
