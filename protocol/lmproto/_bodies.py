"""Encoders and decoders for the bodies of LIST, EXIST_MANY, STATS and error replies.

Strategy: these bodies are small control data, so plain bytes are fine here; object
bodies never pass through this module.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any

from ._codec import encode_key
from ._constants import KEY_SIZE
from ._errors import LocalProtocolError, RemoteProtocolError

MAX_CONTROL_BODY = 4 * 1024 * 1024
"""Largest request body of any command but PUT/PUT_ACK (room for ~27,000 EXIST_MANY keys)."""


MAX_REASON_BODY = 1024
"""Largest reason body of an extension error reply, in bytes."""


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
