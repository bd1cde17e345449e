"""DELETE_MANY and LIST_PAGE (SPEC 8.10, 8.11) against a real server on loopback."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
from wire import Wire

from lmproto import (
    MAX_PAGE_KEYS,
    UNKNOWN_SIZE,
    Command,
    Generation,
    decode_error_text,
    decode_page,
    decode_presence,
    encode_key_list,
    encode_page_request,
)

MiB = 1024 * 1024


@pytest.fixture(params=[Generation.V0, Generation.V1], ids=["v0", "v1"])
def wire(request: pytest.FixtureRequest, server_thread):
    with Wire(server_thread.host, server_thread.port, request.param) as w:
        yield w


def page(
    wire: Wire, prefix: str = "", after: str = "", limit: int = 1000
) -> tuple[list[tuple[str, int]], bool]:
    reply, body = wire.call(Command.LIST_PAGE, prefix, encode_page_request(limit, after))
    assert reply.status == 200, decode_error_text(body)
    return decode_page(body)


def test_delete_many_answers_each_key_in_order(wire: Wire) -> None:
    for key in ["d0", "d2"]:
        wire.put(key, b"x")
    reply, body = wire.call(Command.DELETE_MANY, "", encode_key_list(["d0", "d1", "d2", "d0"]))
    assert reply.status == 200
    assert decode_presence(body) == [True, False, True, False]  # the second d0 is already gone
    assert wire.get("d0") is None and wire.get("d2") is None


def test_delete_many_of_no_keys_and_of_keys_that_cannot_be_stored(wire: Wire) -> None:
    reply, body = wire.call(Command.DELETE_MANY, "", b"")
    assert (reply.status, body) == (200, b"")
    wire.put("kept", b"x")
    raw = b"\x05 kept" + b"\x05kept\x00"  # surrounding whitespace, NUL: never a stored key
    reply, body = wire.call(Command.DELETE_MANY, "", raw)
    assert (reply.status, decode_presence(body)) == (200, [False, False])
    assert wire.get("kept") == b"x"


@pytest.mark.parametrize(
    "bad", [b"\x00", b"\x05abc", b"\x02\xff\xfe"], ids=["empty entry", "short", "not UTF-8"]
)
def test_malformed_delete_many_deletes_nothing_and_the_connection_goes_on(wire: Wire, bad: bytes) -> None:
    wire.put("safe", b"x")
    reply, body = wire.call(Command.DELETE_MANY, "", encode_key_list(["safe"]) + bad)
    assert reply.status == 400 and decode_error_text(body)
    assert wire.get("safe") == b"x"


OVERFLOW = [f"obj{i:02}" for i in range(12)]
"""1 MiB objects that an 8 MiB memory tier cannot all hold: some are only on disk."""


@pytest.fixture
def overflowed(make_server_thread, tmp_path: Path) -> Iterator[Wire]:
    """A connection to a server with a disk tier, holding OVERFLOW."""
    server = make_server_thread(disk=tmp_path / "d", memory_limit=8 * MiB)
    with Wire(server.host, server.port, Generation.V1) as w:
        for key in OVERFLOW:
            assert w.call(Command.PUT_ACK, key, b"z" * MiB)[0].status == 200
        yield w


def test_delete_many_reaches_objects_behind_memory(overflowed: Wire) -> None:
    reply, body = overflowed.call(Command.DELETE_MANY, "", encode_key_list(OVERFLOW))
    assert (reply.status, decode_presence(body)) == (200, [True] * len(OVERFLOW))
    for key in OVERFLOW:
        assert overflowed.call(Command.EXIST, key)[0].status == 400


def test_list_page_walks_every_key_once_in_order_with_sizes(wire: Wire) -> None:
    keys = sorted(f"page/{i:05}" for i in range(2500))
    wire.send_raw(b"".join(wire.frame(Command.PUT, key, b"v" * (i % 7)) for i, key in enumerate(keys)))
    wire.put("other", b"not listed")
    seen: list[tuple[str, int]] = []
    after, more = "", True
    while more:
        entries, more = page(wire, "page/", after, 1000)
        assert len(entries) == (1000 if more else 500)
        seen += entries
        after = entries[-1][0]
    assert seen == [(key, i % 7) for i, key in enumerate(keys)]


def test_list_page_starts_after_the_cursor_and_ends_without_more(wire: Wire) -> None:
    for key in ["a", "b", "c"]:
        wire.put(key, b"xyz")
    assert page(wire, after="a", limit=1) == ([("b", 3)], True)
    assert page(wire, after="b", limit=5) == ([("c", 3)], False)
    assert page(wire, after="c") == ([], False)
    assert page(wire, after="bb", limit=5) == ([("c", 3)], False)  # the cursor need not exist


def test_list_page_is_capped_by_the_server(make_server_thread) -> None:
    server = make_server_thread(max_list_keys=10)
    with Wire(server.host, server.port, Generation.V1) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, f"k{i:03}", b"v") for i in range(30)))
        entries, more = page(w, limit=MAX_PAGE_KEYS + 1)
        assert (len(entries), more) == (10, True)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"\x01\x00",
        struct.pack("<I", 0),
        struct.pack("<I", 5) + b"\xff",
        struct.pack("<I", 5) + b"k" * 151,
    ],
    ids=["empty", "short limit", "limit 0", "cursor not UTF-8", "cursor too long"],
)
def test_malformed_list_page_is_400_and_the_connection_goes_on(wire: Wire, bad: bytes) -> None:
    reply, body = wire.call(Command.LIST_PAGE, "", bad)
    assert reply.status == 400 and decode_error_text(body)
    wire.put("after", b"x")
    assert wire.get("after") == b"x"


def test_list_page_size_is_unknown_for_objects_only_behind_memory(overflowed: Wire) -> None:
    entries, more = page(overflowed, "obj")  # memory holds at most 8 of them: the rest were evicted
    sizes = dict(entries)
    assert not more and sorted(sizes) == OVERFLOW
    assert set(sizes.values()) == {MiB, UNKNOWN_SIZE}
