"""The server's RSS stays within --memory-limit plus a fixed overhead (measured with psutil
on a subprocess server, so the figure is the server's own)."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
from wire import Wire

from lmproto import Command

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
