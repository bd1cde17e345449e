"""The server's RSS stays within --memory-limit plus a fixed overhead (measured with psutil
on a subprocess server, so the figure is the server's own)."""

from __future__ import annotations

import random
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
from wire import Wire

from lmproto import NO_META, Command, decode_json
from lmserver.storage.memory import OBJECT_OVERHEAD

MiB = 1024 * 1024
RSS_OVERHEAD = 16 * MiB
"""What the server may hold beyond --memory-limit and its RSS at start (docs/operating.md "Limits
and timeouts"): staging buffers, reply headers, interpreter churn."""


@contextmanager
def peak_rss(pid: int) -> Iterator[list[int]]:
    """Sample a process's RSS every 10 ms; the list's one item is the peak so far."""
    proc = psutil.Process(pid)
    peak = [proc.memory_info().rss]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            try:
                peak[0] = max(peak[0], proc.memory_info().rss)
            except psutil.Error:
                return

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield peak
    finally:
        done.set()
        thread.join(5)


def test_rss_stays_within_the_limit_over_a_long_overwrite_run(spawn_server) -> None:
    limit = 64 * MiB
    server = spawn_server("--memory-limit", str(limit), "--loop", "asyncio")
    assert server.proc is not None
    start_rss = psutil.Process(server.proc.pid).memory_info().rss
    rng = random.Random(7)
    payload = bytes(8 * MiB)
    written = 0
    with Wire(server.host, server.port) as w, peak_rss(server.proc.pid) as peak:
        # Mixed sizes over a key space larger than memory: constant eviction and reuse of
        # buffers of every size, the pattern that fragments a malloc heap.
        while written < 40 * limit:
            size = rng.choice([64 * 1024, 200 * 1024, 700 * 1024, 1 * MiB + 5, 3 * MiB, 8 * MiB - 7])
            reply, _ = w.call(Command.PUT_ACK, f"k{rng.randrange(200)}", payload[:size])
            assert reply.status == 200
            written += size
    grown = peak[0] - start_rss
    assert grown <= limit + RSS_OVERHEAD, f"RSS grew {grown / MiB:.0f} MiB over a {limit // MiB} MiB limit"


def _stat_counter(host: str, port: int, name: str) -> int:
    with Wire(host, port) as w:
        _, body = w.call(Command.STATS)
        return int(decode_json(body)["counters"].get(name, 0))


def test_unread_gets_on_the_stdlib_loop_cost_little_beyond_the_object(spawn_server) -> None:
    """Clients that never read a large GET cost the server little beyond the object, on the
    standard library's loop too: a plain connection's transport (plain.py) keeps a reference
    to what it cannot send, never a copy. (Its own transport copied; replies were handed to it
    in pieces, which TLS connections on this loop still need: test_tls.py.)"""
    server = spawn_server("--memory-limit", "256MiB", "--loop", "asyncio")
    assert server.proc is not None
    with Wire(server.host, server.port) as w:
        w.put("big", bytes(32 * MiB))
    start_rss = psutil.Process(server.proc.pid).memory_info().rss
    readers = []
    try:
        with peak_rss(server.proc.pid) as peak:
            for _ in range(16):
                reader = Wire(server.host, server.port)
                reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                reader.send(Command.GET, "big")  # and never read
                readers.append(reader)
            deadline = time.monotonic() + 60
            while _stat_counter(server.host, server.port, "gets_served") < 16:
                assert time.monotonic() < deadline, "GETs not served"
                time.sleep(0.05)
            time.sleep(0.2)  # let the last sends fill the sockets
        grown = peak[0] - start_rss
        # Before: each unread reply was copied whole (16 x 32 MiB).
        assert grown <= 16 * MiB + RSS_OVERHEAD, f"RSS grew {grown / MiB:.0f} MiB"
    finally:
        for reader in readers:
            reader.close()


def test_unread_list_replies_are_held_within_the_memory_limit(spawn_server) -> None:
    """LIST replies come from the memory budget: clients sending LISTs over many keys and
    never reading cannot grow the server past --memory-limit."""
    limit = 256 * MiB
    server = spawn_server("--memory-limit", str(limit), "--loop", "asyncio")
    assert server.proc is not None
    with Wire(server.host, server.port) as w:
        prefix = "k" * 144
        for first in range(0, 50_000, 1000):
            batch = range(first, first + 1000)
            w.send_raw(b"".join(w.frame(Command.PUT, f"{prefix}{i:06}", b"v") for i in batch))
        assert w.call(Command.EXIST, f"{prefix}049999")[0].status == 200  # all 50,000 stored
        # The keys' own index (Python objects, outside the limit) now exists: measure from here.
        memory = decode_json(w.call(Command.STATS)[1])["tiers"][0]
        room = limit - memory["reserved_bytes"] - memory["idle_pool_bytes"]
    start_rss = psutil.Process(server.proc.pid).memory_info().rss
    readers = []
    try:
        with peak_rss(server.proc.pid) as peak:
            for _ in range(30):  # each reply is ~7 MiB, more than the kernel's socket buffers
                reader = Wire(server.host, server.port)
                reader.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                reader.send(Command.LIST)  # and never read
                readers.append(reader)
            for reader in readers:  # each reply has started to arrive: it was built
                reader.sock.settimeout(60)
                assert reader.sock.recv(1, socket.MSG_PEEK)
            time.sleep(0.2)
        grown = peak[0] - start_rss
        # Plus one LIST's transient encoding (~7 MiB here), which malloc may keep.
        assert grown <= room + 2 * RSS_OVERHEAD, f"RSS grew {grown / MiB:.0f} MiB"
    finally:
        for reader in readers:
            reader.close()


def _max_map_count() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except OSError:
        return 65530  # Linux's default


def test_more_small_objects_than_the_os_allows_mappings(spawn_server) -> None:
    """Linux allows a process vm.max_map_count mappings (65,530 by default). With one mapping
    per object a store of small objects failed there, far below its memory limit, and took
    the connection with it. Buffers are slots of shared slabs: more objects than that are
    stored, read back, deleted in a scattered half and stored again."""
    count = min(_max_map_count(), 100_000) + 2_000
    server = spawn_server("--memory-limit", str(count * (4096 + OBJECT_OVERHEAD) + 64 * MiB))
    keys = [f"small{i:06}" for i in range(count)]

    def body(key: str) -> bytes:
        return key.encode().ljust(4096, b".")

    with Wire(server.host, server.port) as w:

        def store(batch: list[str]) -> None:
            for first in range(0, len(batch), 500):
                part = batch[first : first + 500]
                w.send_raw(b"".join(w.frame(Command.PUT_ACK, k, body(k), NO_META) for k in part))
                statuses = [w.reply()[0].status for _ in part]
                assert statuses == [200] * len(part)

        store(keys)
        scattered = keys[::2]
        w.send_raw(b"".join(w.frame(Command.DELETE, k) for k in scattered))
        assert {w.reply()[0].status for _ in scattered} == {200}
        store(scattered)
        for key in (keys[0], keys[1], keys[count // 2 + 1], keys[-1]):
            assert w.get(key) == body(key)
        memory = decode_json(w.call(Command.STATS)[1])["tiers"][0]
    assert memory["objects"] == count and memory["evictions"] == 0
    # Slabs double from 1 MiB to 64 MiB (7 of them), then one per 64 MiB: 11 here.
    assert memory["pool_mappings"] <= 7 + count * 4096 // (64 * MiB) + 1
    assert memory["pool_map_failures"] == 0


def test_rss_stays_within_the_limit_with_small_objects(spawn_server) -> None:
    """Each object's metadata (key, index entries, record: ~700 bytes) is charged against
    --memory-limit with its buffer, so small objects keep RSS within the limit too. Counting
    only buffers, 4 KiB objects reached ~1.17x the limit."""
    limit = 256 * MiB
    server = spawn_server("--memory-limit", str(limit))
    assert server.proc is not None
    start_rss = psutil.Process(server.proc.pid).memory_info().rss
    body = b"s" * 4096
    with Wire(server.host, server.port) as w, peak_rss(server.proc.pid) as peak:
        for first in range(0, 2 * limit // 4096, 500):  # twice the limit: constant eviction
            keys = [f"small{i:07}" for i in range(first, first + 500)]
            w.send_raw(b"".join(w.frame(Command.PUT_ACK, key, body) for key in keys))
            assert {w.reply()[0].status for _ in range(500)} == {200}
        memory = decode_json(w.call(Command.STATS)[1])["tiers"][0]
    assert memory["evictions"] > 0
    assert memory["metadata_bytes"] == memory["objects"] * OBJECT_OVERHEAD
    assert peak[0] - start_rss <= limit + RSS_OVERHEAD
