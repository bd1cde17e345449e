"""Encoders and decoders for the bodies of LIST, EXIST_MANY, STATS and error replies.

Strategy: these bodies are small control data, so plain bytes are fine here; object
bodies never pass through this module.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Sequence
from typing import Any

from ._codec import encode_key
from ._constants import KEY_SIZE
from ._errors import LocalProtocolError, RemoteProtocolError

MAX_CONTROL_BODY = 4 * 1024 * 1024
"""Largest request body of any command but PUT/PUT_ACK (room for ~27,000 EXIST_MANY keys)."""


MAX_REASON_BODY = 1024
"""Largest reason body of an extension error reply, in bytes."""

MAX_PAGE_KEYS = 16384
"""Most entries in one LIST_PAGE reply (a server may send fewer): at 155 bytes an entry,
a page stays under MAX_CONTROL_BODY."""

UNKNOWN_SIZE = 0xFFFFFFFF
"""A LIST_PAGE entry's size when the server cannot tell it without I/O (the object is held
only by a tier behind memory)."""

_LIMIT = struct.Struct("<I")
_SIZE = struct.Struct("<I")


class MalformedBody(RemoteProtocolError):
    """A body whose framing was fine but whose content is not what its command carries.

    The stream is still in sync: a server answers FAIL and keeps the connection.
    """


def encode_key_list(keys: Iterable[str]) -> bytes:
    """EXIST_MANY request body: each key as one length byte then its UTF-8 bytes."""
    out = bytearray()
    for key in keys:
        raw = encode_key(key).rstrip(b" ")
        if not raw:
            raise LocalProtocolError("EXIST_MANY keys must not be empty")
        out.append(len(raw))
        out += raw
    if len(out) > MAX_CONTROL_BODY:
        raise LocalProtocolError(f"key list is {len(out)} bytes; the limit is {MAX_CONTROL_BODY}")
    return bytes(out)


def decode_key_list(body: bytes | bytearray | memoryview) -> list[str]:
    """Keys of an EXIST_MANY body; raises MalformedBody on anything else."""
    view = memoryview(body)
    keys: list[str] = []
    pos, end = 0, len(view)
    while pos < end:
        size = view[pos]
        pos += 1
        if size == 0 or size > KEY_SIZE or pos + size > end:
            raise MalformedBody(f"bad key entry of {size} bytes at offset {pos - 1}")
        try:
            keys.append(bytes(view[pos : pos + size]).decode("utf-8"))
        except UnicodeDecodeError:
            raise MalformedBody(f"key at offset {pos - 1} is not valid UTF-8") from None
        pos += size
    return keys


def encode_presence(hits: Sequence[bool]) -> bytes:
    """EXIST_MANY reply body: one byte per key, 1 present, 0 absent, in request order."""
    return bytes(1 if hit else 0 for hit in hits)


def decode_presence(body: bytes | bytearray | memoryview) -> list[bool]:
    return [b != 0 for b in bytes(body)]


def hit_prefix(hits: Sequence[bool]) -> int:
    """How many keys from the start are all present (LMCache's prefix lookup answer)."""
    for i, hit in enumerate(hits):
        if not hit:
            return i
    return len(hits)


def encode_key_lines(keys: Iterable[str]) -> bytes:
    """LIST reply body: UTF-8 keys joined by newlines, as upstream v0 sends them."""
    return "\n".join(keys).encode("utf-8")


def decode_key_lines(body: bytes | bytearray | memoryview) -> list[str]:
    if not body:
        return []
    try:
        return bytes(body).decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise MalformedBody("LIST body is not valid UTF-8") from None


def encode_json(value: dict[str, Any]) -> bytes:
    """STATS reply body."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode("utf-8")


def decode_json(body: bytes | bytearray | memoryview) -> dict[str, Any]:
    """STATS reply body. UTF-8 only (``json.loads`` on bytes would also guess UTF-16/32)."""
    try:
        value = json.loads(bytes(body).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # ValueError covers Unicode and JSON errors
        raise MalformedBody(f"body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise MalformedBody("JSON body is not an object")
    return value


def encode_error_text(message: str) -> bytes:
    """Body of an error reply to an extension command: a short UTF-8 reason.

    Cut to MAX_REASON_BODY bytes at a character boundary, so the body stays valid UTF-8.
    """
    raw = message.encode("utf-8")
    if len(raw) <= MAX_REASON_BODY:
        return raw
    return raw[:MAX_REASON_BODY].decode("utf-8", errors="ignore").encode("utf-8")


def decode_error_text(body: bytes | bytearray | memoryview) -> str:
    return bytes(body).decode("utf-8", errors="replace")


def encode_page_request(limit: int, after: str = "") -> bytes:
    """LIST_PAGE request body: the most entries wanted (u32 LE, >= 1), then the key the
    page starts after (UTF-8, no length byte; empty for the first page)."""
    if not 1 <= limit <= 0xFFFFFFFF:
        raise LocalProtocolError(f"page limit {limit} is not in 1..{0xFFFFFFFF}")
    raw = encode_key(after).rstrip(b" ") if after else b""
    return _LIMIT.pack(limit) + raw


def decode_page_request(body: bytes | bytearray | memoryview) -> tuple[int, str]:
    """(limit, after) of a LIST_PAGE request body; raises MalformedBody on anything else."""
    view = memoryview(body)
    if len(view) < _LIMIT.size or len(view) > _LIMIT.size + KEY_SIZE:
        raise MalformedBody(f"LIST_PAGE body of {len(view)} bytes; it has 4 to {4 + KEY_SIZE}")
    (limit,) = _LIMIT.unpack_from(view)
    if limit == 0:
        raise MalformedBody("LIST_PAGE limit is 0")
    try:
        after = bytes(view[_LIMIT.size :]).decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedBody("LIST_PAGE start key is not valid UTF-8") from None
    return limit, after


def encode_page(entries: Sequence[tuple[str, int]], more: bool) -> bytes:
    """LIST_PAGE reply body: one byte, 1 if keys follow the last entry (ask again, starting
    after it) else 0; then each entry as a length byte, the key's UTF-8 bytes and its size
    in bytes (u32 LE; UNKNOWN_SIZE when the server cannot tell)."""
    out = bytearray(b"\x01" if more else b"\x00")
    for key, size in entries:
        raw = key.encode("utf-8")
        if not 1 <= len(raw) <= KEY_SIZE:
            raise LocalProtocolError(f"key of {len(raw)} bytes cannot be listed")
        out.append(len(raw))
        out += raw
        out += _SIZE.pack(min(size, UNKNOWN_SIZE))
    return bytes(out)


def decode_page(body: bytes | bytearray | memoryview) -> tuple[list[tuple[str, int]], bool]:
    """(entries, more) of a LIST_PAGE reply body; raises MalformedBody on anything else."""
    view = memoryview(body)
    if not view or view[0] > 1:
        raise MalformedBody("LIST_PAGE reply lacks its leading 0 or 1 byte")
    entries: list[tuple[str, int]] = []
    pos, end = 1, len(view)
    while pos < end:
        size = view[pos]
        if size == 0 or size > KEY_SIZE or pos + 1 + size + _SIZE.size > end:
            raise MalformedBody(f"bad LIST_PAGE entry at offset {pos}")
        try:
            key = bytes(view[pos + 1 : pos + 1 + size]).decode("utf-8")
        except UnicodeDecodeError:
            raise MalformedBody(f"LIST_PAGE key at offset {pos} is not valid UTF-8") from None
        pos += 1 + size
        entries.append((key, _SIZE.unpack_from(view, pos)[0]))
        pos += _SIZE.size
    return entries, view[0] == 1
