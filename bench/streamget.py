"""``python -m bench stream-get``: GET latency on a socket that also streams PUTs.

Strategy: LMCache's connectors send stores and retrievals over one socket, so what an engine
feels is the latency of a GET queued behind a stream of PUTs. One connection, two threads: a
sender streams fire-and-forget PUTs (distinct keys, ``--size`` bytes) and, after every
``--every`` PUTs, one GET of a small preloaded object, noting when it handed the GET to the
kernel; a reader takes the GET replies in order and records each one's latency. The same
run drives memory-only lmserver and lmserver with ``--disk`` (and optionally any other
server command), one at a time, so the ratio disk/memory is the figure to read: with the
tier chain it should be ~1, because a slow disk skips writes instead of stalling the socket.
"""

from __future__ import annotations

import collections
import json
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from lmproto import REPLY_SIZE, Command, Generation, decode_reply, encode_request

from .drivers import Reader
from .targets import start_lmserver

GEN = Generation.V0
SMALL = 64 * 1024


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _preload(port: int, keys: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        reader = Reader(sock)
        body = b"g" * SMALL
        for i in range(keys):
            sock.sendall(encode_request(Command.PUT_ACK, f"g{i}", SMALL, generation=GEN) + body)
            reply = decode_reply(reader.read(REPLY_SIZE[GEN]), GEN)
            reader.readinto(memoryview(bytearray(reply.length)))


def measure(port: int, size: int, every: int, duration: float) -> dict[str, Any]:
    """Stream PUTs for ``duration`` seconds with a GET after every ``every`` PUTs."""
    _preload(port, 64)
    body = memoryview(bytearray(b"p" * size))
    sent: collections.deque[float] = collections.deque()
    latencies: list[float] = []
    misses = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        stop = threading.Event()
        done_sending = threading.Event()
        gets = 0
        puts = 0

        def send() -> None:
            nonlocal gets, puts
            deadline = time.perf_counter() + duration
            i = 0
            while time.perf_counter() < deadline:
                sock.sendmsg([encode_request(Command.PUT, f"s{i}", size, generation=GEN), body])
                puts += 1
                i += 1
                if i % every == 0:
                    frame = encode_request(Command.GET, f"g{gets % 64}", 0, generation=GEN)
                    sent.append(time.perf_counter())
                    sock.sendall(frame)
                    gets += 1
            sending_ended[0] = time.perf_counter()
            # A last GET, counted before done_sending is set: the receiver, whatever it has
            # checked, always has one more reply to read and never blocks after the end.
            frame = encode_request(Command.GET, f"g{gets % 64}", 0, generation=GEN)
            sent.append(time.perf_counter())
            gets += 1
            done_sending.set()
            sock.sendall(frame)

        def receive() -> None:
            nonlocal misses
            reader = Reader(sock)
            scratch = memoryview(bytearray(SMALL))
            got = 0
            while not (done_sending.is_set() and got == gets) and not stop.is_set():
                reply = decode_reply(reader.read(REPLY_SIZE[GEN]), GEN)
                reader.readinto(scratch[: reply.length])
                latencies.append(time.perf_counter() - sent.popleft())
                misses += reply.status != 200
                got += 1

        started = time.perf_counter()
        sending_ended = [started]
        threads = [threading.Thread(target=send), threading.Thread(target=receive)]
        for t in threads:
            t.start()
        threads[0].join()
        threads[1].join(60)
        stop.set()
        elapsed = sending_ended[0] - started  # the PUT stream's own window, not the drain
    us = [v * 1e6 for v in latencies]
    return {
        "put_gbps": round(puts * size / elapsed / 1e9, 3),
        "gets": len(us),
        "get_misses": misses,
        "get_p50_us": round(_percentile(us, 0.50), 1),
        "get_p99_us": round(_percentile(us, 0.99), 1),
        "get_max_us": round(max(us), 1) if us else None,
    }


def run_stream_get(
    size: int, every: int, duration: float, out: Path, variants: list[tuple[str, list[str]]], cmd: str | None
) -> list[dict[str, Any]]:
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, extra in variants:
        with tempfile.TemporaryDirectory(prefix="lmbench-streamget-") as tmp:
            args = [a.replace("{tmp}", tmp) for a in extra]
            target = start_lmserver(name, out, cmd, args, "2GiB")
            if target.spec is None:
                results.append({"target": name, "note": target.note})
                continue
            try:
                figures = measure(target.spec.port, size, every, duration)
                row = {"target": name, "args": " ".join(extra), **figures}
            finally:
                target.stop()
            results.append(row)
    (out / "streamget.json").write_text(json.dumps(results, indent=2))
    return results


def format_stream_get(results: list[dict[str, Any]], size: int, every: int) -> str:
    lines = [
        f"GET ({SMALL // 1024} KiB) latency on one socket that streams {size >> 20} MiB PUTs "
        f"(a GET after every {every} PUTs)",
        "",
        "| target | PUT stream GB/s | GETs | misses | GET p50 µs | GET p99 µs | GET max µs |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "note" in r:
            lines.append(f"| {r['target']} | {r['note']} | | | | | |")
            continue
        lines.append(
            f"| {r['target']} | {r['put_gbps']} | {r['gets']} | {r['get_misses']} | {r['get_p50_us']} "
            f"| {r['get_p99_us']} | {r['get_max_us']} |"
        )
    return "\n".join(lines)
