"""LMCache's RemoteBackend against real lmservers, through the plugin and through LMCache's
built-in lm:// connector: store, batched lookup, retrieve (bytes, shape, dtype), servers
killed and restarted, three servers with one stopped."""

from __future__ import annotations

from typing import Any

import pytest

from lmclient import Client

from .conftest import CHUNK, Engine, check_retrieved, chunk_key, wait_for

N = 64


def url(server: Any) -> str:
    return f"lm://{server.host}:{server.port}"


@pytest.mark.parametrize("via", ["plugin", "builtin"])
def test_store_lookup_retrieve(engines: Any, server_thread: Any, via: str) -> None:
    engine: Engine = engines([url(server_thread)], via)
    if via == "plugin":
        assert type(engine.connector).__name__ == "LMServerConnector"  # loaded by LMCache's framework
    keys = [chunk_key(i) for i in range(N)]
    tail = CHUNK // 2  # the last chunk of a prompt is usually partial
    objs = [engine.chunk(i) for i in range(N - 1)] + [engine.chunk(N - 1, tokens=tail)]
    engine.store(keys[: N // 2], objs[: N // 2], batched=via == "plugin")
    engine.store(keys[N // 2 :], objs[N // 2 :], batched=False)

    assert engine.lookup(keys) == N
    assert engine.lookup([*keys[:10], chunk_key(10_000), *keys[10:]]) == 10  # the hit prefix
    assert engine.backend.contains(keys[3]) and not engine.backend.contains(chunk_key(10_001))

    check_retrieved(engine.retrieve(keys[: N - 1]), range(N - 1))
    check_retrieved(engine.retrieve(keys[N - 1 :]), [N - 1], tokens=tail)
    single = engine.backend.get_blocking(keys[5])
    check_retrieved([single], [5])
    assert engine.retrieve([chunk_key(10_002)]) == [None]

    with Client(server_thread.host, server_thread.port) as client:  # the server holds them all
        assert sorted(client.list()) == sorted(k.to_string() for k in keys)


def test_plugin_and_builtin_connector_share_objects(engines: Any, server_thread: Any) -> None:
    """Objects stored through either connector read back through the other (same wire)."""
    plugin = engines([url(server_thread)], "plugin")
    builtin = engines([url(server_thread)], "builtin")
    plugin.store([chunk_key(1)], [plugin.chunk(1)])
    builtin.store([chunk_key(2)], [builtin.chunk(2)], batched=False)
    assert plugin.lookup([chunk_key(1), chunk_key(2)]) == 2
    assert builtin.lookup([chunk_key(1), chunk_key(2)]) == 2
    check_retrieved(builtin.retrieve([chunk_key(1)]), [1])
    check_retrieved(plugin.retrieve([chunk_key(2)]), [2])


def test_plugin_fast_paths(engines: Any, server_thread: Any) -> None:
    engine = engines([url(server_thread)], "plugin")
    connector = engine.connector
    assert connector.support_batched_contains() and connector.support_batched_get()
    assert connector.support_batched_put() and connector.support_ping()
    keys = [chunk_key(i) for i in range(8)]
    engine.store(keys, [engine.chunk(i) for i in range(8)])
    assert engine.run(connector.ping()) == 0
    assert engine.run(connector.batched_async_contains("lookup-1", keys)) == 8
    assert sorted(engine.run(connector.list())) == sorted(k.to_string() for k in keys)
    assert engine.backend.remove(keys[2]) is True
    assert engine.backend.remove(keys[2]) is False
    assert engine.lookup(keys) == 2
    assert connector.exists_sync(keys[1]) and not connector.exists_sync(keys[2])
    assert not connector.errors


def test_server_killed_and_restarted_mid_run(engines: Any, spawn_server: Any) -> None:
    server = spawn_server()
    engine = engines([url(server)], "plugin")
    keys = [chunk_key(i) for i in range(32)]
    engine.store(keys[:16], [engine.chunk(i) for i in range(16)])
    assert engine.lookup(keys[:16]) == 16

    server.kill()
    # The engine sees misses, never an exception; puts are dropped.
    assert engine.lookup(keys[:16]) == 0
    assert engine.retrieve(keys[:4]) == [None] * 4
    assert engine.backend.get_blocking(keys[0]) is None
    assert not engine.backend.contains(keys[0])
    engine.store(keys[16:20], [engine.chunk(i) for i in range(16, 20)])
    assert engine.run(engine.connector.ping()) == 1
    assert engine.connector.client.counters["server_down"] >= 1
    assert engine.connector.errors["unavailable"] >= 4 + 4  # each GET and PUT above, at least

    server.restart()  # an empty server on the same port: the plugin reconnects after backoff

    def stored_again() -> bool:
        engine.store(keys[20:21], [engine.chunk(20)])
        return engine.lookup(keys[20:21]) == 1

    wait_for(stored_again, "the plugin to reconnect")
    engine.store(keys[21:], [engine.chunk(i) for i in range(21, 32)])
    assert engine.lookup(keys[20:]) == 12
    check_retrieved(engine.retrieve(keys[20:]), range(20, 32))
    assert engine.lookup(keys[:16]) == 0  # lost with the killed server's memory


def test_three_servers_one_stopped(engines: Any, make_server_thread: Any, spawn_server: Any) -> None:
    servers = [make_server_thread(), make_server_thread(), spawn_server()]
    engine = engines([url(s) for s in servers], "plugin")
    keys = [chunk_key(i) for i in range(90)]
    engine.store(keys, [engine.chunk(i) for i in range(90)])
    assert engine.lookup(keys) == 90
    client = engine.connector.client
    lost = {i for i, k in enumerate(keys) if client.server_for(k.to_string()) == url(servers[2])[5:]}
    assert 10 <= len(lost) <= 50  # rendezvous hashing spreads the chunks
    for server in servers:  # each holds exactly the chunks placed on it
        with Client(server.host, server.port) as alone:
            placed = {k.to_string() for k in keys if client.server_for(k.to_string()) == url(server)[5:]}
            assert set(alone.list()) == placed

    servers[2].kill()
    first_lost = min(lost)
    assert engine.lookup(keys) == first_lost  # the prefix ends at its first chunk
    got = engine.retrieve(keys)
    assert [i for i, obj in enumerate(got) if obj is None] == sorted(lost)
    kept = [i for i in range(90) if i not in lost]
    check_retrieved([got[i] for i in kept], kept)
    # New chunks on the live servers are stored; those of the stopped one are dropped.
    more = [chunk_key(i) for i in range(100, 130)]
    engine.store(more, [engine.chunk(i) for i in range(100, 130)])
    hits = [engine.backend.contains(k) for k in more]
    assert hits == [client.server_for(k.to_string()) != url(servers[2])[5:] for k in more]


def test_retrieve_beyond_the_cpu_buffer_misses_without_blocking(engines: Any, server_thread: Any) -> None:
    """LMCache's allocator full: the plugin never waits for memory on LMCache's event loop
    (nothing could free it meanwhile); the chunks that do not fit are misses."""
    engine = engines([url(server_thread)], "plugin", cpu_gib=1 / 1024)  # room for ~60 chunks
    keys = [chunk_key(i) for i in range(100)]
    for start in range(0, 100, 25):
        engine.store(keys[start : start + 25], [engine.chunk(i) for i in range(start, start + 25)])
    assert engine.lookup(keys) == 100
    got = engine.retrieve(keys)
    fitted = [i for i, obj in enumerate(got) if obj is not None]
    assert 0 < len(fitted) < 100
    assert engine.connector.errors["get (refused)"] == 100 - len(fitted)
    check_retrieved([got[i] for i in fitted], fitted)
    check_retrieved(engine.retrieve(keys[90:]), range(90, 100))  # memory back: served again


def test_plugin_in_the_scheduler_role(engines: Any, server_thread: Any) -> None:
    """LMCache's scheduler creates connectors without a CPU backend or metadata, only to
    look keys up; the plugin works there too."""
    from lmcache.v1.storage_backend.connector import CreateConnector

    engine = engines([url(server_thread)], "plugin")
    engine.store([chunk_key(7)], [engine.chunk(7)])
    scheduler = CreateConnector("plugin://lmserver", engine.loop, None, engine.config, None, "lmserver")
    try:
        assert scheduler.exists_sync(chunk_key(7)) and not scheduler.exists_sync(chunk_key(8))
        assert scheduler.batched_contains([chunk_key(7), chunk_key(8)]) == 1
    finally:
        engine.run(scheduler.close())
