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

from lmproto import Command, decode_json

MiB = 1024 * 1024
RSS_OVERHEAD = 16 * MiB
"""What the server may hold beyond --memory-limit and its RSS at start (README "Limits and
timeouts"): staging buffers, reply headers, interpreter churn."""


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


def test_unread_gets_on_the_stdlib_loop_copy_at_most_a_piece_each(spawn_server) -> None:
    """The standard library's transport copies what it cannot send; replies are handed to it
    in pieces, so clients that never read cost the server little beyond the object."""
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
