"""Capacity is never exceeded, LRU order is kept, many clients are served at once."""

from __future__ import annotations

import hashlib
import random
import threading

import psutil
from wire import Wire

from lmproto import Command, decode_json, decode_key_lines
from lmserver.storage.memory import OBJECT_OVERHEAD

MiB = 1024 * 1024


def payload(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def test_capacity_never_exceeded_and_lru_kept(make_server_thread) -> None:
    limit = 16 * MiB
    server = make_server_thread(memory_limit=limit)
    memory = server.server.state.store.memory
    peak = 0
    with Wire(server.host, server.port) as w:
        for i in range(64):  # 4x the limit in 1 MiB objects
            w.put(f"obj{i}", payload(f"obj{i}", MiB))
            if i >= 8:
                assert w.get("obj3") == payload("obj3", MiB)  # read recently: must survive
            peak = max(peak, server.call(lambda: memory.pool.in_use + memory.pool.idle))
            assert server.call(lambda: memory.bytes) <= limit
        assert peak <= limit
        present = decode_key_lines(w.call(Command.LIST)[1])
        assert "obj3" in present
        assert "obj0" not in present and "obj10" not in present  # the oldest untouched went first
        assert "obj63" in present and "obj62" in present  # the newest stayed
        stats = decode_json(w.call(Command.STATS)[1])["tiers"][0]
        assert stats["evictions"] == 64 - stats["objects"]
        assert stats["bytes"] <= limit


def test_exist_does_not_refresh_recency(make_server_thread) -> None:
    server = make_server_thread(memory_limit=4 * (MiB + OBJECT_OVERHEAD))  # room for 4 objects
    with Wire(server.host, server.port) as w:
        for i in range(4):
            w.put(f"k{i}", b"x" * (MiB - 4096))
        assert w.call(Command.EXIST, "k0")[0].status == 200  # a lookup, not a use
        w.put("k4", b"x" * (MiB - 4096))
        assert w.call(Command.EXIST, "k0")[0].status == 400
        assert w.get("k1") is not None


def test_process_rss_bounded_while_writing_4x_limit(spawn_server) -> None:
    proc = spawn_server("--memory-limit", "64MiB")
    process = psutil.Process(proc.proc.pid)
    baseline = process.memory_info().rss
    blob = b"r" * (4 * MiB)
    with Wire(proc.host, proc.port) as w:
        for i in range(64):  # 256 MiB through a 64 MiB server
            w.send(Command.PUT, f"r{i}", blob)
            if i % 8 == 7:
                assert w.call(Command.HEALTH)[0].status == 200
                assert process.memory_info().rss - baseline < 64 * MiB + 48 * MiB
        stats = decode_json(w.call(Command.STATS)[1])["tiers"][0]
    assert stats["bytes"] <= 64 * MiB and stats["evictions"] >= 48


def test_fifty_concurrent_clients_get_their_own_data(server_thread) -> None:
    errors: list[BaseException] = []

    def client(n: int) -> None:
        try:
            rng = random.Random(n)
            with Wire(server_thread.host, server_thread.port) as w:
                for j in range(20):
                    key = f"c{n}-{j}"
                    data = payload(key, rng.choice([100, 5000, 70_000, 300_000]))
                    w.send(Command.PUT, key, data)
                    assert w.get(key) == data
                    assert w.call(Command.EXIST, key)[0].status == 200
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(50)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]


def test_thousand_idle_connections_while_others_are_served(server_thread) -> None:
    idle = [Wire(server_thread.host, server_thread.port) for _ in range(1000)]
    try:
        with Wire(server_thread.host, server_thread.port) as active:
            for i in range(50):
                active.put(f"a{i}", b"busy")
                assert active.get(f"a{i}") == b"busy"
            stats = decode_json(active.call(Command.STATS)[1])
            assert stats["connections"]["current"] == 1001
        assert idle[500].call(Command.HEALTH)[0].status == 200  # and they still work
    finally:
        for w in idle:
            w.close()
