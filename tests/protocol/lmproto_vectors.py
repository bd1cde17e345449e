"""Loading and interpreting protocol/vectors.json for the lmproto tests.

Strategy: one place knows the vector file's shape (documented in SPEC.md and in
protocol/tools/make_vectors.py); the tests ask it for frames and their meanings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lmproto
from lmproto import Command, Generation, ObjectMeta, Reply, ReplyDecoder, Request, RequestDecoder

ROOT = Path(__file__).resolve().parents[2]
VECTORS_PATH = ROOT / "protocol" / "vectors.json"
MAKE_VECTORS = ROOT / "protocol" / "tools" / "make_vectors.py"

DOCUMENT: dict[str, Any] = json.loads(VECTORS_PATH.read_text(encoding="utf-8"))
VECTORS: list[dict[str, Any]] = DOCUMENT["vectors"]

VALID = [v for v in VECTORS if "error" not in v and "problem" not in v]
PROBLEMS = [v for v in VECTORS if "problem" in v]
ERRORS = [v for v in VECTORS if "error" in v]


def ids(vectors: list[dict[str, Any]]) -> list[str]:
    return [v["name"] for v in vectors]


def meta_of(decoded: dict[str, Any]) -> ObjectMeta:
    """The meta a decoded vector states; v0 frames carry none."""
    if "meta" not in decoded:
        return lmproto.NO_META
    m = decoded["meta"]
    return ObjectMeta(m["fmt"], m["dtype"], tuple(m["shape"]), m["location"])


def generation(vector: dict[str, Any]) -> Generation:
    return Generation(vector["generation"])


def decode_all(vector: dict[str, Any], chunks: list[bytes] | None = None) -> list[tuple[Any, bytes]]:
    """Feed a vector's bytes (optionally in the given chunks) then EOF; all frames out."""
    gen = generation(vector)
    decoder: RequestDecoder | ReplyDecoder
    decoder = RequestDecoder(gen) if vector["direction"] == "request" else ReplyDecoder(gen)
    data = bytes.fromhex(vector["hex"])
    frames: list[tuple[Any, bytes]] = []
    for chunk in [data] if chunks is None else chunks:
        decoder.feed(chunk)
        frames.extend(drain(decoder))
    decoder.feed(b"")
    frames.extend(drain(decoder))
    return frames


def drain(decoder: RequestDecoder | ReplyDecoder) -> list[tuple[Any, bytes]]:
    out: list[tuple[Any, bytes]] = []
    while True:
        frame = decoder.next_frame()
        if frame is lmproto.NEED_DATA:
            return out
        out.append(frame)


def body_meaning(vector: dict[str, Any], header: Request | Reply, body: bytes) -> dict[str, Any] | None:
    """Decode a body the way its command defines it (None for opaque bodies)."""
    if isinstance(header, Request):
        if header.command in (Command.EXIST_MANY, Command.DELETE_MANY):
            return {"keys": lmproto.decode_key_list(body)}
        if header.command == Command.LIST_PAGE:
            limit, after = lmproto.decode_page_request(body)
            return {"limit": limit, "after": after}
        return None
    answered = vector.get("in_reply_to")
    if not header.ok:
        if answered in {c.name for c in lmproto.EXTENSION_COMMANDS}:
            return {"reason": lmproto.decode_error_text(body)}
        return None
    if answered == "LIST":
        return {"keys": lmproto.decode_key_lines(body)}
    if answered == "EXIST_MANY":
        presence = lmproto.decode_presence(body)
        return {"presence": presence, "hit_prefix": lmproto.hit_prefix(presence)}
    if answered == "DELETE_MANY":
        return {"deleted": lmproto.decode_presence(body)}
    if answered == "LIST_PAGE":
        entries, more = lmproto.decode_page(body)
        return {"entries": [list(entry) for entry in entries], "more": more}
    if answered == "STATS":
        return {"json": lmproto.decode_json(body)}
    return None


def encode_body(vector: dict[str, Any], meaning: dict[str, Any]) -> bytes:
    """Encode a body meaning with lmproto's body encoders."""
    if "keys" in meaning:
        if vector["direction"] == "request":
            return lmproto.encode_key_list(meaning["keys"])
        return lmproto.encode_key_lines(meaning["keys"])
    if "presence" in meaning:
        return lmproto.encode_presence(meaning["presence"])
    if "deleted" in meaning:
        return lmproto.encode_presence(meaning["deleted"])
    if "limit" in meaning:
        return lmproto.encode_page_request(meaning["limit"], meaning["after"])
    if "entries" in meaning:
        return lmproto.encode_page([tuple(entry) for entry in meaning["entries"]], meaning["more"])
    if "json" in meaning:
        return lmproto.encode_json(meaning["json"])
    if "reason" in meaning:
        return lmproto.encode_error_text(meaning["reason"])
    raise AssertionError(f"unknown body meaning {meaning}")
