"""Several servers behind one client: rendezvous placement, per-server splitting of
multi-key commands, and a server that is down (its keys miss, then it comes back)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from typing import Any

import pytest

from lmclient import AsyncClient, Client, InvalidRequest, Retry, ServerDown
from lmclient._config import parse_servers
from lmclient._placement import Address, Placement, key_hash

KEYS = [f"model@1@0@{i:016x}@bfloat16" for i in range(300)]
FAST_RETRY = Retry(retries=1, base=0.01, cap=0.02)


def test_hashes_are_stable_across_processes() -> None:
    # Pinned values: placement must never change between versions, processes or machines
    # (Python's hash() is salted per process; every client must agree on where keys live).
    assert key_hash("model@1@0@0000000000000000@bfloat16") == 0x7E02201A4B488144
    servers = [Address("10.0.0.1", 65432), Address("10.0.0.2", 65432), Address("10.0.0.3", 65432)]
    placement = Placement(servers, 4)
    assert [placement.server(k) for k in KEYS[:12]] == [1, 1, 0, 0, 2, 1, 1, 1, 0, 1, 2, 0]
    assert [placement.lane(k) for k in KEYS[:12]] == [0, 0, 1, 2, 2, 3, 0, 1, 2, 2, 1, 2]
    first = [Placement(servers, 4).server(k) for k in KEYS[:20]]
    again = [Placement(list(reversed(servers)), 4).server(k) for k in KEYS[:20]]
    assert [servers[i] for i in first] == [list(reversed(servers))[i] for i in again]  # order-free


def test_rendezvous_moves_only_the_lost_servers_keys() -> None:
    servers = [Address("h", 7000 + i) for i in range(4)]
    before = Placement(servers, 4)
    after = Placement(servers[:2] + servers[3:], 4)
    owner = {k: servers[before.server(k)] for k in KEYS}
    moved = [k for k in KEYS if (servers[:2] + servers[3:])[after.server(k)] != owner[k]]
    assert moved and all(owner[k] == servers[2] for k in moved)  # only the lost server's keys
    shares = Counter(owner.values())
    assert all(40 <= n <= 110 for n in shares.values()), shares  # ~75 each


def test_lanes_spread_a_servers_keys() -> None:
    placement = Placement([Address("h", 1)], 4)
    assert Counter(placement.lane(k) for k in KEYS).keys() == {0, 1, 2, 3}
    assert all(placement.lane(k) == placement.lane(k) for k in KEYS)


def test_server_lists_parse() -> None:
    assert parse_servers("lm://a:1,b:2,[::1]:3,c") == [
        Address("a", 1),
        Address("b", 2),
        Address("::1", 3),
        Address("c", 65432),
    ]
    for bad in ("lm://a:1,,b:2", "lm://a:0", "redis://a:1", "lm://[::1:3"):
        with pytest.raises(InvalidRequest):
            parse_servers(bad)
    with pytest.raises(InvalidRequest):
        Client(servers=["a:1", "lm://a:1"])  # the same server twice
    client = Client.from_url("lm://a:1,b:2")
    assert client.settings.servers == (Address("a", 1), Address("b", 2))
    assert "lm://a:1,b:2" in repr(client)


@pytest.fixture
def three(make_server_thread: Any, spawn_server: Any) -> list[Any]:
    """Three real servers; the last one a subprocess that a test can kill and restart."""
    return [make_server_thread(), make_server_thread(), spawn_server()]


def test_keys_live_on_their_rendezvous_server(make_client: Any, three: list[Any]) -> None:
    client = make_client("", 0, servers=[(s.host, s.port) for s in three])
    client.put_many(KEYS, [k.encode() for k in KEYS])
    assert client.get_many(KEYS) == [k.encode() for k in KEYS]
    hits = client.exists_many([*KEYS[:50], "absent", *KEYS[50:]])
    assert hits == [True] * 50 + [False] + [True] * 250
    placed: Counter[str] = Counter()
    for server in three:
        address = f"{server.host}:{server.port}"
        with Client(server.host, server.port) as alone:
            held = set(alone.list())
        assert held == {k for k in KEYS if client.server_for(k) == address}
        placed[address] = len(held)
    assert all(n >= 60 for n in placed.values()), placed
    assert sorted(client.list()) == sorted(KEYS)
    assert client.health()
    assert set(client.stats()) == {f"{s.host}:{s.port}" for s in three}
    buffers = [bytearray(len(k)) for k in KEYS]
    assert client.get_many_into(KEYS, buffers) == [len(k) for k in KEYS]
    assert [bytes(b) for b in buffers] == [k.encode() for k in KEYS]


def test_a_stopped_server_misses_then_comes_back(make_client: Any, three: list[Any]) -> None:
    client = make_client("", 0, servers=[(s.host, s.port) for s in three], retry=FAST_RETRY)
    client.put_many(KEYS, [b"v"] * len(KEYS), ack=True)
    down = three[2]
    lost = {k for k in KEYS if client.server_for(k) == f"{down.host}:{down.port}"}
    down.kill()

    # Its keys miss; the engine-facing answers never raise.
    assert client.exists_many(KEYS) == [k not in lost for k in KEYS]
    assert client.get_many(KEYS) == [None if k in lost else b"v" for k in KEYS]
    some = sorted(lost)[0]
    assert client.get(some) is None and client.exists(some) is False
    client.put(some, b"dropped")  # fire-and-forget: dropped and counted
    with pytest.raises(ServerDown):
        client.put(some, b"x", ack=True)  # an acknowledged PUT tells the caller
    assert client.health() is False
    assert sorted(client.list()) == sorted(set(KEYS) - lost)
    counts = client.counters
    assert counts["server_down"] >= 1 and counts["dropped_puts"] >= 1 and counts["unavailable"] > len(lost)

    # The other servers are unaffected, and the lost server is tried again after backoff.
    other = next(k for k in KEYS if k not in lost)
    assert client.get(other) == b"v"
    down.restart()
    deadline = time.monotonic() + 60
    while client.exists(some) is False and client.get(some) is None:
        client.put(some, b"back")  # dropped while the server still counts as down
        assert time.monotonic() < deadline, "the restarted server was never tried again"
        time.sleep(0.05)
    assert client.get(some) == b"back"
    assert client.health()


async def test_a_burst_against_a_down_server_is_one_failure(server_thread: Any) -> None:
    with socket.socket() as probe:  # a port nothing listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()[1]
    servers = [(server_thread.host, server_thread.port), ("127.0.0.1", dead)]
    async with AsyncClient(servers=servers, retry=FAST_RETRY) as client:
        keys = [k for k in KEYS if client.server_for(k) == f"127.0.0.1:{dead}"][:50]
        assert await asyncio.gather(*(client.get(k) for k in keys)) == [None] * 50
        # 50 concurrent failures are one failed attempt: one backoff step, one log line
        assert client.counters["server_down"] == 1
        assert client.counters["unavailable"] == 50
        assert await client.exists_many(KEYS[:20]) == [False] * 20  # nothing stored on either
