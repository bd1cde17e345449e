"""Replay protocol/vectors.json against lmproto in both directions."""

from __future__ import annotations

import importlib.util
from collections import Counter
from typing import Any

import pytest
from lmproto_vectors import (
    DOCUMENT,
    ERRORS,
    MAKE_VECTORS,
    PROBLEMS,
    VALID,
    VECTORS,
    body_meaning,
    decode_all,
    encode_body,
    generation,
    ids,
    meta_of,
)

import lmproto
from lmproto import Command, Generation, Reply, Request


def check_request(vector: dict[str, Any], header: Request, body: bytes) -> None:
    d = vector["decoded"]
    assert header.command == d["command"]
    assert header.length == d["length"] == len(body)
    if "key" in d:
        assert header.key == d["key"]
    assert header.meta == meta_of(d)
    assert header.generation == generation(vector)
    assert body.hex() == d["body_hex"]
    if "command_name" in d:
        assert header.known_command is Command[d["command_name"]]


def check_reply(vector: dict[str, Any], header: Reply, body: bytes) -> None:
    d = vector["decoded"]
    assert header.status == d["status"]
    assert header.length == d["length"] == len(body)
    assert header.meta == meta_of(d)
    assert header.generation == generation(vector)
    assert header.ok == (d["status"] == 200)
    assert body.hex() == d["body_hex"]


def test_vector_file_is_fresh() -> None:
    """vectors.json is exactly what make_vectors.py (struct only, no lmproto) generates."""
    spec = importlib.util.spec_from_file_location("lmproto_make_vectors", MAKE_VECTORS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--check"]) == 0
    source = MAKE_VECTORS.read_text(encoding="utf-8")
    assert "import lmproto" not in source and "from lmproto" not in source


def test_vector_coverage() -> None:
    assert len(VECTORS) >= 40
    assert len({v["name"] for v in VECTORS}) == len(VECTORS), "vector names must be unique"
    seen = Counter(
        (v["direction"], v["generation"], v["decoded"]["command_name"])
        for v in VALID
        if v["direction"] == "request"
    )
    for gen in (0, 1):
        for command in Command:
            assert seen[("request", gen, command.name)], f"no v{gen} {command.name} request vector"
    answered = {(v["generation"], v["in_reply_to"]) for v in VALID if v["direction"] == "reply"}
    for gen in (0, 1):
        for command in Command:
            if command is not Command.PUT:  # plain PUT has no reply
                assert (gen, command.name) in answered, f"no v{gen} reply to {command.name}"
    assert {v["error"] for v in ERRORS} == {"RemoteProtocolError", "MalformedBody"}


@pytest.mark.parametrize("vector", VALID, ids=ids(VALID))
def test_decode_valid(vector: dict[str, Any]) -> None:
    frames = decode_all(vector)
    assert len(frames) == 1
    header, body = frames[0]
    if vector["direction"] == "request":
        assert isinstance(header, Request)
        assert header.problem is None
        check_request(vector, header, body)
    else:
        assert isinstance(header, Reply)
        check_reply(vector, header, body)
    if "body" in vector["decoded"]:
        assert body_meaning(vector, header, body) == vector["decoded"]["body"]


@pytest.mark.parametrize("vector", VALID, ids=ids(VALID))
def test_decode_header_in_place(vector: dict[str, Any]) -> None:
    """decode_request/decode_reply read a header at an offset inside a larger buffer."""
    data = bytearray(b"\xaa" * 7) + bytes.fromhex(vector["hex"])
    gen = generation(vector)
    if vector["direction"] == "request":
        header: Request | Reply = lmproto.decode_request(memoryview(data), gen, 7)
    else:
        header = lmproto.decode_reply(data, gen, 7)
    assert header == decode_all(vector)[0][0]


@pytest.mark.parametrize("vector", VALID, ids=ids(VALID))
def test_encode_valid(vector: dict[str, Any]) -> None:
    d = vector["decoded"]
    gen = generation(vector)
    body = bytes.fromhex(d["body_hex"])
    if "body" in d:
        assert encode_body(vector, d["body"]) == body
    if vector["direction"] == "request":
        header = lmproto.encode_request(d["command"], d["key"], d["length"], generation=gen, meta=meta_of(d))
        expected = vector.get("canonical_hex", vector["hex"])
    else:
        header = lmproto.encode_reply(d["status"], d["length"], generation=gen, meta=meta_of(d))
        expected = vector["hex"]
    assert (
        len(header) == (lmproto.REQUEST_SIZE if vector["direction"] == "request" else lmproto.REPLY_SIZE)[gen]
    )
    assert (header + body).hex() == expected


@pytest.mark.parametrize("vector", VALID, ids=ids(VALID))
def test_one_byte_at_a_time(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    assert decode_all(vector, [data[i : i + 1] for i in range(len(data))]) == decode_all(vector)


REQUESTS = [v for v in VECTORS if v["direction"] == "request"]
ENCODABLE_PROBLEMS = [v for v in PROBLEMS if "key" in v["decoded"]]


@pytest.mark.parametrize("vector", REQUESTS, ids=ids(REQUESTS))
def test_detect_generation(vector: dict[str, Any]) -> None:
    data = bytes.fromhex(vector["hex"])
    if len(data) < lmproto.DETECT_SIZE:
        assert lmproto.detect_generation(data) is None
        return
    expected = vector.get("detected_generation", vector["generation"])
    assert lmproto.detect_generation(data) == Generation(expected)


@pytest.mark.parametrize("vector", PROBLEMS, ids=ids(PROBLEMS))
def test_problem_frames_stay_framed(vector: dict[str, Any]) -> None:
    """An unservable request decodes with a problem and leaves the stream in sync."""
    data = bytes.fromhex(vector["hex"])
    follow = lmproto.encode_request(Command.HEALTH, generation=generation(vector))
    frames = decode_all({**vector, "hex": (data + follow).hex()})
    assert len(frames) == 2
    (header, body), (after, _) = frames
    assert header.problem
    check_request(vector, header, body)
    assert after.command == Command.HEALTH and after.problem is None


@pytest.mark.parametrize("vector", ENCODABLE_PROBLEMS, ids=ids(ENCODABLE_PROBLEMS))
def test_encode_problem_frames(vector: dict[str, Any]) -> None:
    """Problems that the encoder can still express (unknown command, empty key) encode exactly."""
    d = vector["decoded"]
    header = lmproto.encode_request(
        d["command"], d["key"], d["length"], generation=generation(vector), meta=meta_of(d)
    )
    assert (header + bytes.fromhex(d["body_hex"])).hex() == vector["hex"]


@pytest.mark.parametrize("vector", ERRORS, ids=ids(ERRORS))
def test_invalid_frames_raise(vector: dict[str, Any]) -> None:
    error = getattr(lmproto, vector["error"])
    assert issubclass(error, lmproto.ProtocolError)
    with pytest.raises(error):
        for header, body in decode_all(vector):
            body_meaning(vector, header, body)
    if "decoded" in vector:  # the frame itself is fine, only its body is malformed
        [(header, body)] = decode_all(vector)
        assert header.problem is None
        check_request(vector, header, body)


def test_top_level_too_long_key() -> None:
    key = DOCUMENT["too_long_key"]
    assert len(key.encode("utf-8")) == lmproto.KEY_SIZE + 1
    with pytest.raises(lmproto.LocalProtocolError):
        lmproto.encode_key(key)
    assert lmproto.encode_key(key[:-1]) == key[:-1].encode("utf-8")
