"""Batch calls that answer per key: ``return_exceptions``, DELETE_MANY and LIST_PAGE, through
both clients against real servers (and a fake older server for the DELETE_MANY fallback)."""

from __future__ import annotations

from typing import Any

import pytest

from lmclient import BufferTooSmall, ConnectError, ServerError
from lmproto import Command, Generation

KEYS = [f"model@00000000@0@{i:064x}" for i in range(120)]


def test_put_many_reports_each_refusal_and_stores_the_rest(make_client: Any, make_server_thread: Any) -> None:
    server = make_server_thread(max_object_size=1024)
    client = make_client(server.host, server.port)
    outcomes = client.put_many(["a", "big", "c"], [b"1", b"x" * 4096, b"3"], ack=True, return_exceptions=True)
    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], ServerError) and outcomes[1].status == 413
    assert client.get_many(["a", "big", "c"]) == [b"1", None, b"3"]
    with pytest.raises(ServerError):  # the default is unchanged: the first error is raised
        client.put_many(["big", "d"], [b"x" * 4096, b"4"], ack=True)
    assert client.put_many(["e"], [b"5"]) is None


def test_get_many_into_reports_a_buffer_too_small_and_fills_the_others(client: Any) -> None:
    client.put_many(["s", "l"], [b"ab", b"abcdef"])
    buffers = [bytearray(2), bytearray(3), bytearray(3)]
    outcomes = client.get_many_into(["s", "l", "absent"], buffers, return_exceptions=True)
    assert outcomes[0] == 2 and outcomes[2] is None
    assert isinstance(outcomes[1], BufferTooSmall)
    assert bytes(buffers[0]) == b"ab" and bytes(buffers[1]) == b"\0\0\0"  # left untouched
    with pytest.raises(BufferTooSmall):
        client.get_many_into(["l"], [bytearray(3)])


def test_a_dead_server_fails_only_its_own_keys(
    make_client: Any, make_server_thread: Any, spawn_server: Any
) -> None:
    alive, doomed = make_server_thread(), spawn_server()
    servers = [(alive.host, alive.port), (doomed.host, doomed.port)]
    client = make_client("", 0, servers=servers, skip_down=False, retry=0)
    client.put_many(KEYS, [k.encode() for k in KEYS], ack=True)
    lost = {k for k in KEYS if client.server_for(k) == f"{doomed.host}:{doomed.port}"}
    assert 0 < len(lost) < len(KEYS)
    doomed.kill()
    for outcomes in (
        client.get_many(KEYS, return_exceptions=True),
        client.put_many(KEYS, [b"v"] * len(KEYS), ack=True, return_exceptions=True),
        client.delete_many(KEYS, return_exceptions=True),
    ):
        failed = {k for k, outcome in zip(KEYS, outcomes, strict=True) if isinstance(outcome, ConnectError)}
        assert failed == lost
    assert client.get_many([k for k in KEYS if k not in lost]) == [None] * (len(KEYS) - len(lost))


def test_delete_many_answers_each_key_over_several_servers(make_client: Any, make_server_thread: Any) -> None:
    servers = [make_server_thread() for _ in range(3)]
    client = make_client("", 0, servers=[(s.host, s.port) for s in servers])
    client.put_many(KEYS[::2], [b"x"] * len(KEYS[::2]))  # plain PUTs: DELETE_MANY follows them in lane
    assert client.delete_many(KEYS) == [i % 2 == 0 for i in range(len(KEYS))]
    assert client.exists_many(KEYS) == [False] * len(KEYS)
    assert client.delete_many([]) == []


def test_delete_many_falls_back_to_deletes_on_an_older_server(make_client: Any, fake_upstream: Any) -> None:
    old = fake_upstream(Generation.V1, "delete")
    client = make_client(old.host, old.port)
    client.put_many(["a", "b"], [b"1", b"2"])
    assert client.delete_many(["a", "x", "b"]) == [True, False, True]
    tried = old.commands.count(Command.DELETE_MANY)  # one per lane holding some of the keys
    assert client.delete_many(["a"]) == [False]  # remembered: no DELETE_MANY again
    assert old.commands.count(Command.DELETE_MANY) == tried
    assert old.commands.count(Command.DELETE) == 4


def test_list_page_walks_several_servers_in_key_order(make_client: Any, make_server_thread: Any) -> None:
    servers = [make_server_thread() for _ in range(3)]
    client = make_client("", 0, servers=[(s.host, s.port) for s in servers])
    client.put_many(KEYS, [bytes(i % 5) for i in range(len(KEYS))])
    client.put("other", b"not listed")
    seen: list[tuple[str, int | None]] = []
    after: str | None = ""
    while after is not None:
        entries, after = client.list_page("model@", after=after, limit=25)
        assert len(entries) <= 25
        seen += entries
    assert seen == sorted((k, i % 5) for i, k in enumerate(KEYS))
    assert client.list_page("absent") == ([], None)
