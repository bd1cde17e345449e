"""Generate ``protocol/vectors.json``, the golden frames of the lm:// wire protocol.

Strategy: every expected byte here is built with ``struct`` and literal numbers taken from
``protocol/SPEC.md``, never with ``lmproto``, so replaying the vectors against the codec
is an independent check of it. Run from anywhere:

    python protocol/tools/make_vectors.py          # rewrite protocol/vectors.json
    python protocol/tools/make_vectors.py --check  # exit 1 if the file is stale

Vector fields (see SPEC.md, "Golden vectors"):
    name, direction ("request" | "reply"), generation (0 | 1), hex (the whole frame:
    header then body), and then one of
    decoded   what the frame means; for a request: command, length, key, meta (v1), body_hex
              and, where the body has structure, body; for a reply: status, length, meta (v1),
              body_hex, body. ``in_reply_to`` names the command a reply answers.
    problem   the frame is well framed but unservable: the server answers FAIL (no reply to
              PUT) and keeps the connection. ``decoded`` still gives the fields that survive.
    error     decoding fails with this lmproto exception class.
Optional: canonical_hex (what an encoder emits for the same meaning when ``hex`` uses
another accepted padding), detected_generation (when detection disagrees with the
generation), note.
"""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parent.parent / "vectors.json"

# Numbers from SPEC.md, written out on purpose instead of imported.
PUT, GET, EXIST, LIST, HEALTH = 1, 2, 3, 4, 5
PUT_ACK, DELETE, EXIST_MANY, STATS, DELETE_MANY, LIST_PAGE = 101, 102, 103, 104, 105, 106
NAMES = {
    PUT: "PUT",
    GET: "GET",
    EXIST: "EXIST",
    LIST: "LIST",
    HEALTH: "HEALTH",
    PUT_ACK: "PUT_ACK",
    DELETE: "DELETE",
    EXIST_MANY: "EXIST_MANY",
    STATS: "STATS",
    DELETE_MANY: "DELETE_MANY",
    LIST_PAGE: "LIST_PAGE",
}
OK, FAIL, NOT_FOUND, TOO_LARGE, UNAVAILABLE, NO_SPACE = 200, 400, 404, 413, 503, 507

NO_META = (0, 0, (0, 0, 0, 0), 0)  # fmt, dtype, shape, location
PLACEHOLDER = (1, 2, (0, 0, 0, 0), 0)  # fmt KV_2LTD, dtype float16

V0_REQ = "<ii150s"
V1_REQ = "<iiiiiiiii150s"
V0_REP = "<ii"
V1_REP = "<iiiiiiiii"

LLAMA_KEY = "meta-llama/Llama-3.1-8B-Instruct@1@0@5f1c0e8d9a7b6c43@bfloat16"
V0_KEY = "vllm-llama-8b@1@0@8c2a61f0e4d7b935"


def space_pad(key: str) -> bytes:
    return key.encode("utf-8").ljust(150, b" ")


def nul_pad(key: str) -> bytes:
    return key.encode("utf-8").ljust(150, b"\x00")


def meta_dict(meta: tuple[int, int, tuple[int, int, int, int], int]) -> dict[str, Any]:
    fmt, dtype, shape, location = meta
    return {"fmt": fmt, "dtype": dtype, "shape": list(shape), "location": location}


def req_header(gen: int, command: int, length: int, field: bytes, meta: Any = NO_META) -> bytes:
    if gen == 0:
        return struct.pack(V0_REQ, command, length, field)
    fmt, dtype, shape, location = meta
    return struct.pack(V1_REQ, command, length, fmt, dtype, location, *shape, field)


def rep_header(gen: int, status: int, length: int, meta: Any = PLACEHOLDER) -> bytes:
    if gen == 0:
        return struct.pack(V0_REP, status, length)
    fmt, dtype, shape, location = meta
    return struct.pack(V1_REP, status, length, fmt, dtype, *shape, location)


VECTORS: list[dict[str, Any]] = []


def request(
    name: str,
    gen: int,
    command: int,
    key: str,
    body: bytes = b"",
    *,
    meta: Any = NO_META,
    field: bytes | None = None,
    body_meaning: dict[str, Any] | None = None,
    note: str | None = None,
) -> None:
    """A valid request; ``field`` overrides the space-padded key field (non-canonical)."""
    name = name.replace(" ", " request ", 1)
    canonical = req_header(gen, command, len(body), space_pad(key), meta) + body
    wire = canonical if field is None else req_header(gen, command, len(body), field, meta) + body
    decoded: dict[str, Any] = {"command": command, "command_name": NAMES[command], "length": len(body)}
    decoded["key"] = key
    if gen == 1:
        decoded["meta"] = meta_dict(meta)
    decoded["body_hex"] = body.hex()
    if body_meaning is not None:
        decoded["body"] = body_meaning
    vector: dict[str, Any] = {"name": name, "direction": "request", "generation": gen, "hex": wire.hex()}
    vector["decoded"] = decoded
    if wire != canonical:
        vector["canonical_hex"] = canonical.hex()
    if note:
        vector["note"] = note
    VECTORS.append(vector)


def reply(
    name: str,
    gen: int,
    in_reply_to: int | str,
    status: int,
    body: bytes = b"",
    *,
    meta: Any = PLACEHOLDER,
    body_meaning: dict[str, Any] | None = None,
    note: str | None = None,
) -> None:
    name = name.replace(" ", " reply ", 1)
    wire = rep_header(gen, status, len(body), meta) + body
    decoded: dict[str, Any] = {"status": status, "length": len(body)}
    if gen == 1:
        decoded["meta"] = meta_dict(meta)
    decoded["body_hex"] = body.hex()
    if body_meaning is not None:
        decoded["body"] = body_meaning
    vector: dict[str, Any] = {
        "name": name,
        "direction": "reply",
        "generation": gen,
        "in_reply_to": NAMES[in_reply_to] if isinstance(in_reply_to, int) else in_reply_to,
        "hex": wire.hex(),
        "decoded": decoded,
    }
    if note:
        vector["note"] = note
    VECTORS.append(vector)


def invalid(
    name: str,
    direction: str,
    gen: int,
    wire: bytes,
    *,
    error: str | None = None,
    problem: str | None = None,
    decoded: dict[str, Any] | None = None,
    in_reply_to: int | None = None,
    note: str | None = None,
) -> None:
    vector: dict[str, Any] = {"name": f"v{gen} {direction} {name}", "direction": direction, "generation": gen}
    if in_reply_to is not None:
        vector["in_reply_to"] = NAMES[in_reply_to]
    vector["hex"] = wire.hex()
    if error is not None:
        vector["error"] = error
    if problem is not None:
        vector["problem"] = problem
    if decoded is not None:
        vector["decoded"] = decoded
    if note:
        vector["note"] = note
    VECTORS.append(vector)


def key_list(keys: list[str]) -> bytes:
    out = b""
    for key in keys:
        raw = key.encode("utf-8")
        out += bytes([len(raw)]) + raw
    return out


def page_request(limit: int, after: str = "") -> bytes:
    return struct.pack("<I", limit) + after.encode("utf-8")


def page_body(entries: list[tuple[str, int]], more: bool) -> bytes:
    out = b"\x01" if more else b"\x00"
    for key, size in entries:
        raw = key.encode("utf-8")
        out += bytes([len(raw)]) + raw + struct.pack("<I", size)
    return out


def stats_body(doc: dict[str, Any]) -> bytes:
    return json.dumps(doc, separators=(",", ":"), sort_keys=True).encode("utf-8")


STATS_DOC: dict[str, Any] = {
    "version": "0.1.0",
    "uptime_s": 3600.5,
    "connections": {"current": 3, "total": 17},
    "tiers": [
        {"name": "memory", "objects": 2, "bytes": 131072, "capacity": 8589934592},
        {"name": "disk", "objects": 5, "bytes": 327680, "capacity": 107374182400},
    ],
    "hits": 40,
    "misses": 2,
    "evictions": 1,
    "refusals": 0,
}

KEY_150 = "ключ" * 18 + "k" * 6  # 4 Cyrillic letters = 8 bytes, so 144 + 6 = 150 bytes
KEY_151 = "é" * 75 + "x"  # 151 bytes: one too many


def build() -> dict[str, Any]:
    VECTORS.clear()
    assert len(KEY_150.encode("utf-8")) == 150
    tensor = bytes(range(16))  # 2*1*2*2 float16 values = 16 bytes
    v1_meta = (1, 2, (2, 1, 2, 2), 1)  # KV_2LTD, float16, shape, LocalCPUBackend

    # ---- generation 0 requests -------------------------------------------------------
    request("v0 PUT", 0, PUT, V0_KEY, b"hello")
    request("v0 PUT empty value", 0, PUT, "empty-object", b"", note="length 0 is a valid object")
    request("v0 PUT 150-byte multi-byte key", 0, PUT, KEY_150, b"\x00\x01\x02")
    request("v0 GET", 0, GET, V0_KEY)
    request(
        "v0 GET NUL-padded key",
        0,
        GET,
        V0_KEY,
        field=nul_pad(V0_KEY),
        note="NUL padding is accepted; encoders pad with spaces",
    )
    request(
        "v0 GET space-surrounded key field",
        0,
        GET,
        "abc",
        field=b"  abc".ljust(150, b" "),
        note="leading whitespace is stripped when decoding, so it cannot be part of a key",
    )
    request("v0 GET multi-byte UTF-8 key", 0, GET, "clé/日本語/🔑")
    request("v0 GET with a body (ignored)", 0, GET, "k1", b"xyz", note="body read and ignored")
    request("v0 EXIST", 0, EXIST, V0_KEY)
    request("v0 LIST all (all-space key)", 0, LIST, "", note="upstream clients send 150 spaces")
    request("v0 LIST with prefix", 0, LIST, "vllm-llama-8b@")
    request(
        "v0 LIST NUL-padded empty key",
        0,
        LIST,
        "",
        field=b"\x00" * 150,
        note="valid v0 frame, but detection reads it as v1: use --protocol v0 for such clients",
    )
    VECTORS[-1]["detected_generation"] = 1
    request("v0 HEALTH", 0, HEALTH, "", note="extension for v0; upstream v0 servers never answer")
    request("v0 PUT_ACK", 0, PUT_ACK, V0_KEY, b"hello")
    request("v0 DELETE", 0, DELETE, V0_KEY)
    keys3 = [V0_KEY, "clé", "k" * 150]
    request(
        "v0 EXIST_MANY three keys",
        0,
        EXIST_MANY,
        "",
        key_list(keys3),
        body_meaning={"keys": keys3},
    )
    request("v0 EXIST_MANY no keys", 0, EXIST_MANY, "", b"", body_meaning={"keys": []})
    request("v0 STATS", 0, STATS, "")
    request("v0 DELETE_MANY three keys", 0, DELETE_MANY, "", key_list(keys3), body_meaning={"keys": keys3})
    request(
        "v0 LIST_PAGE first page",
        0,
        LIST_PAGE,
        "vllm-llama-8b@",
        page_request(500),
        body_meaning={"limit": 500, "after": ""},
        note="no start key: the page begins with the first matching key",
    )

    # ---- generation 0 replies --------------------------------------------------------
    reply("v0 GET hit", 0, GET, OK, b"hello")
    reply("v0 GET hit empty object", 0, GET, OK, b"")
    reply("v0 GET miss", 0, GET, FAIL)
    reply("v0 EXIST present", 0, EXIST, OK)
    reply("v0 EXIST absent", 0, EXIST, FAIL)
    lst = ["a", "b/c", "clé"]
    reply("v0 LIST three keys", 0, LIST, OK, "\n".join(lst).encode(), body_meaning={"keys": lst})
    reply("v0 LIST empty store", 0, LIST, OK, b"", body_meaning={"keys": []})
    reply("v0 HEALTH", 0, HEALTH, OK)
    reply("v0 unknown command refused", 0, "unknown", FAIL, note="reply to an unknown command: 400, no body")
    reply("v0 PUT_ACK stored", 0, PUT_ACK, OK)
    msg = "object of 2147483647 bytes exceeds --max-object-size 1073741824"
    reply("v0 PUT_ACK too large", 0, PUT_ACK, TOO_LARGE, msg.encode(), body_meaning={"reason": msg})
    msg = "no space: store full of pinned objects"
    reply("v0 PUT_ACK no space", 0, PUT_ACK, NO_SPACE, msg.encode(), body_meaning={"reason": msg})
    msg = "shutting down"
    reply("v0 PUT_ACK unavailable", 0, PUT_ACK, UNAVAILABLE, msg.encode(), body_meaning={"reason": msg})
    reply("v0 PUT_ACK bad request no reason", 0, PUT_ACK, FAIL, body_meaning={"reason": ""})
    reply("v0 DELETE deleted", 0, DELETE, OK)
    reply("v0 DELETE not found", 0, DELETE, NOT_FOUND, body_meaning={"reason": ""})
    pres = [True, True, False]
    reply(
        "v0 EXIST_MANY",
        0,
        EXIST_MANY,
        OK,
        b"\x01\x01\x00",
        body_meaning={"presence": pres, "hit_prefix": 2},
    )
    body = stats_body(STATS_DOC)
    reply("v0 STATS", 0, STATS, OK, body, body_meaning={"json": STATS_DOC})
    deleted = [True, False, True]
    reply("v0 DELETE_MANY", 0, DELETE_MANY, OK, b"\x01\x00\x01", body_meaning={"deleted": deleted})
    reply(
        "v0 DELETE_MANY from a server without it",
        0,
        DELETE_MANY,
        FAIL,
        body_meaning={"reason": ""},
        note="400 with no body: an unknown command's answer (a client falls back to DELETEs)",
    )
    last = {"entries": [], "more": False}
    reply("v0 LIST_PAGE last page empty", 0, LIST_PAGE, OK, b"\x00", body_meaning=last)

    # ---- generation 1 requests -------------------------------------------------------
    request("v1 PUT with tensor meta", 1, PUT, LLAMA_KEY, tensor, meta=v1_meta)
    request("v1 PUT NUL-padded key", 1, PUT, LLAMA_KEY, tensor, meta=v1_meta, field=nul_pad(LLAMA_KEY))
    request("v1 PUT empty value", 1, PUT, "empty-object", b"", meta=(4, 6, (0, 0, 0, 0), 1))
    request("v1 PUT 150-byte multi-byte key", 1, PUT, KEY_150, b"\xff", meta=(4, 6, (1, 0, 0, 0), 1))
    request(
        "v1 PUT unknown fmt survives",
        1,
        PUT,
        "future-format",
        b"\x00\x00",
        meta=(9, 9, (1, 2, 0, 0), 2),
        note="fmt/dtype are carried as integers; unknown values are stored and returned as sent",
    )
    request("v1 GET", 1, GET, LLAMA_KEY, meta=(1, 2, (0, 0, 0, 0), 1), note="request meta is ignored")
    request("v1 GET multi-byte UTF-8 key", 1, GET, "clé/日本語/🔑", meta=PLACEHOLDER)
    request("v1 EXIST", 1, EXIST, LLAMA_KEY, meta=PLACEHOLDER)
    request("v1 LIST all", 1, LIST, "", meta=NO_META)
    request("v1 LIST with prefix", 1, LIST, "meta-llama/", meta=NO_META)
    request("v1 HEALTH", 1, HEALTH, "", meta=PLACEHOLDER)
    request("v1 PUT_ACK", 1, PUT_ACK, LLAMA_KEY, tensor, meta=v1_meta)
    request("v1 DELETE", 1, DELETE, LLAMA_KEY)
    keys2 = [LLAMA_KEY, LLAMA_KEY.replace("5f1c", "6a2d")]
    request("v1 EXIST_MANY", 1, EXIST_MANY, "", key_list(keys2), body_meaning={"keys": keys2})
    request("v1 STATS", 1, STATS, "")
    request("v1 DELETE_MANY", 1, DELETE_MANY, "", key_list(keys2), body_meaning={"keys": keys2})
    request(
        "v1 LIST_PAGE after a cursor",
        1,
        LIST_PAGE,
        "meta-llama/",
        page_request(2, LLAMA_KEY),
        body_meaning={"limit": 2, "after": LLAMA_KEY},
        note="the page holds the first keys greater than the start key",
    )

    # ---- generation 1 replies --------------------------------------------------------
    reply("v1 GET hit with meta", 1, GET, OK, tensor, meta=v1_meta)
    reply(
        "v1 GET hit of an object stored through v0",
        1,
        GET,
        OK,
        b"hello",
        meta=NO_META,
        note="v0 frames carry no meta: fmt 0, dtype 0, zero shape, location 0",
    )
    reply("v1 GET miss", 1, GET, FAIL)
    reply("v1 EXIST present", 1, EXIST, OK)
    reply("v1 EXIST absent", 1, EXIST, FAIL)
    reply("v1 LIST", 1, LIST, OK, "\n".join(lst).encode(), body_meaning={"keys": lst})
    reply("v1 HEALTH", 1, HEALTH, OK)
    reply("v1 PUT_ACK stored", 1, PUT_ACK, OK)
    msg = "object too large"
    reply("v1 PUT_ACK too large", 1, PUT_ACK, TOO_LARGE, msg.encode(), body_meaning={"reason": msg})
    reply("v1 DELETE deleted", 1, DELETE, OK)
    reply("v1 DELETE not found", 1, DELETE, NOT_FOUND, body_meaning={"reason": ""})
    reply(
        "v1 EXIST_MANY",
        1,
        EXIST_MANY,
        OK,
        b"\x00\x01",
        body_meaning={"presence": [False, True], "hit_prefix": 0},
    )
    reply("v1 STATS", 1, STATS, OK, body, body_meaning={"json": STATS_DOC})
    reply("v1 DELETE_MANY", 1, DELETE_MANY, OK, b"\x00\x01", body_meaning={"deleted": [False, True]})
    listed = [(LLAMA_KEY.replace("5f1c", "6a2d"), 16), (LLAMA_KEY.replace("5f1c", "7b3e"), 0xFFFFFFFF)]
    reply(
        "v1 LIST_PAGE with more to come",
        1,
        LIST_PAGE,
        OK,
        page_body(listed, True),
        body_meaning={"entries": [list(e) for e in listed], "more": True},
        note="0xFFFFFFFF: size unknown (held only behind memory); the next page starts after the last key",
    )
    msg = "LIST_PAGE limit is 0"
    reply("v1 LIST_PAGE bad request", 1, LIST_PAGE, FAIL, msg.encode(), body_meaning={"reason": msg})

    # ---- invalid frames --------------------------------------------------------------
    rpe = "RemoteProtocolError"
    invalid(
        "negative length",
        "request",
        0,
        req_header(0, PUT, -1, space_pad("k")),
        error=rpe,
        note="stream cannot be framed: connection closed, nothing stored",
    )
    invalid(
        "negative length",
        "request",
        1,
        req_header(1, GET, -2147483648, space_pad("k"), PLACEHOLDER),
        error=rpe,
    )
    invalid("negative length", "reply", 0, rep_header(0, OK, -5), error=rpe, in_reply_to=GET)
    invalid("negative length", "reply", 1, rep_header(1, OK, -1), error=rpe, in_reply_to=GET)
    invalid(
        "truncated header",
        "request",
        0,
        req_header(0, GET, 0, space_pad("k"))[:100],
        error=rpe,
        note="end of stream inside the header",
    )
    invalid(
        "truncated body",
        "request",
        1,
        req_header(1, PUT, 16, space_pad("k"), PLACEHOLDER) + b"\x00" * 10,
        error=rpe,
        note="end of stream inside the body: the partial PUT is never stored",
    )
    invalid("truncated header", "reply", 0, rep_header(0, OK, 0)[:5], error=rpe, in_reply_to=GET)
    invalid("truncated body", "reply", 1, rep_header(1, OK, 8) + b"abc", error=rpe, in_reply_to=GET)
    invalid(
        "unknown command",
        "request",
        0,
        req_header(0, 7, 3, space_pad("k")) + b"abc",
        problem="unknown command",
        decoded={"command": 7, "length": 3, "key": "k", "body_hex": "616263"},
        note="body discarded, reply 400 length 0, connection goes on",
    )
    invalid(
        "unknown command",
        "request",
        1,
        req_header(1, 6, 0, space_pad(""), PLACEHOLDER),
        problem="unknown command",
        decoded={"command": 6, "length": 0, "key": "", "meta": meta_dict(PLACEHOLDER), "body_hex": ""},
    )
    invalid(
        "GET key not UTF-8",
        "request",
        0,
        req_header(0, GET, 0, b"ab\xff\xfe".ljust(150, b" ")),
        problem="key is not valid UTF-8",
        decoded={"command": GET, "length": 0, "body_hex": ""},
    )
    invalid(
        "PUT key not UTF-8",
        "request",
        1,
        req_header(1, PUT, 2, b"\xc3(".ljust(150, b"\x00"), PLACEHOLDER) + b"zz",
        problem="key is not valid UTF-8",
        decoded={"command": PUT, "length": 2, "meta": meta_dict(PLACEHOLDER), "body_hex": "7a7a"},
        note="PUT: body discarded, no reply",
    )
    invalid(
        "GET NUL inside key",
        "request",
        0,
        req_header(0, GET, 0, b"ab\x00cd".ljust(150, b" ")),
        problem="key contains NUL",
        decoded={"command": GET, "length": 0, "body_hex": ""},
    )
    invalid(
        "GET empty key",
        "request",
        0,
        req_header(0, GET, 0, space_pad("")),
        problem="empty key",
        decoded={"command": GET, "length": 0, "key": "", "body_hex": ""},
    )
    invalid(
        "PUT empty key",
        "request",
        1,
        req_header(1, PUT, 1, space_pad(""), PLACEHOLDER) + b"x",
        problem="empty key",
        decoded={"command": PUT, "length": 1, "key": "", "meta": meta_dict(PLACEHOLDER), "body_hex": "78"},
    )
    bad_bodies = [
        ("zero-length entry", b"\x00"),
        ("entry runs past the end", b"\x05abc"),
        ("entry longer than 150 bytes", b"\x97" + b"k" * 151),
        ("entry not UTF-8", b"\x02\xff\xfe"),
    ]
    for what, bad in bad_bodies:
        invalid(
            f"EXIST_MANY body: {what}",
            "request",
            0,
            req_header(0, EXIST_MANY, len(bad), space_pad("")) + bad,
            error="MalformedBody",
            decoded={"command": EXIST_MANY, "length": len(bad), "key": "", "body_hex": bad.hex()},
            note="well framed: the server answers 400 and the connection goes on",
        )
    for what, bad in [("limit 0", page_request(0)), ("shorter than the limit", b"\x05\x00")]:
        invalid(
            f"LIST_PAGE body: {what}",
            "request",
            1,
            req_header(1, LIST_PAGE, len(bad), space_pad(""), PLACEHOLDER) + bad,
            error="MalformedBody",
            decoded={
                "command": LIST_PAGE,
                "length": len(bad),
                "key": "",
                "meta": meta_dict(PLACEHOLDER),
                "body_hex": bad.hex(),
            },
            note="well framed: the server answers 400 and the connection goes on",
        )
    bad_replies = [
        ("LIST_PAGE entry runs past the end", 0, LIST_PAGE, b"\x00\x03ab"),
        ("STATS body not a JSON object", 1, STATS, b"[1,2]"),
    ]
    for what, gen, answered, bad in bad_replies:
        invalid(
            what,
            "reply",
            gen,
            rep_header(gen, OK, len(bad)) + bad,
            error="MalformedBody",
            in_reply_to=answered,
        )
    return {
        "description": (
            "Golden frames of the lm:// protocol (both generations) and lmserver's extensions. "
            "See protocol/SPEC.md; generated by protocol/tools/make_vectors.py."
        ),
        "too_long_key": KEY_151,
        "vectors": list(VECTORS),
    }


def render() -> str:
    return json.dumps(build(), indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if OUT.read_text(encoding="utf-8") != text:
            print(f"{OUT} is stale; run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(build()['vectors'])} vectors to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
