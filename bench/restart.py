"""``python -m bench restart``: how fast lmserver comes back with many objects on its disk tier.

Strategy: fill a disk tier through a real server (pipelined PUT_ACKs of small objects), then
restart the server three ways and time each from process start to its ``listening`` line:
after a clean SIGTERM (the SQLite index is loaded in LRU order, no record is read), after a
SIGKILL (each segment is read above its watermark, space no record covers is given back), and
with the index deleted (it is rebuilt from the record headers). A start with an empty disk is
the baseline, so the index
load rate is ``objects / (restart time - baseline)``. After each restart a sample of objects
is read back and checked byte for byte.
"""

from __future__ import annotations

import json
import random
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmproto import REPLY_SIZE, Command, Generation, decode_reply, encode_request

from .drivers import Reader
from .targets import Target, start_lmserver

GEN = Generation.V0


def _value(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "little") * (size // 8 + 1))[:size]


def _fill(port: int, objects: int, size: int) -> float:
    """Store ``objects`` objects with pipelined PUT_ACKs; returns objects per second."""
    start = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        reader = Reader(sock)
        for first in range(0, objects, 1000):
            batch = range(first, min(first + 1000, objects))
            frames = [
                part
                for i in batch
                for part in (encode_request(Command.PUT_ACK, f"r{i}", size, generation=GEN), _value(i, size))
            ]
            sock.sendall(b"".join(frames))
            for _ in batch:
                reply = decode_reply(reader.read(REPLY_SIZE[GEN]), GEN)
                reader.readinto(memoryview(bytearray(reply.length)))  # a reason text, if any
                if reply.status != 200:
                    raise RuntimeError(f"PUT_ACK answered {reply.status}")
    return objects / (time.perf_counter() - start)


def _check_sample(port: int, objects: int, size: int, sample: int = 200) -> int:
    """How many of a random sample of objects come back byte-identical."""
    good = 0
    with socket.create_connection(("127.0.0.1", port)) as sock:
        reader = Reader(sock)
        for i in random.Random(7).sample(range(objects), min(sample, objects)):
            sock.sendall(encode_request(Command.GET, f"r{i}", generation=GEN))
            reply = decode_reply(reader.read(REPLY_SIZE[GEN]), GEN)
            body = bytearray(reply.length)
            reader.readinto(memoryview(body))
            good += reply.status == 200 and body == _value(i, size)
    return good


def _timed_start(out: Path, disk: Path) -> tuple[Target, float]:
    started = time.perf_counter()
    target = start_lmserver(
        "restart",
        out,
        None,
        ["--disk", str(disk), "--disk-limit", "64GiB"],
        memory_limit="64MiB",
        startup=300,
    )
    if target.spec is None:
        raise RuntimeError(f"lmserver did not start: {target.note}")
    return target, time.perf_counter() - started


def run_restart(objects: int, size: int, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="lmbench-restart-") as tmp:
        disk = Path(tmp) / "data"
        target, baseline = _timed_start(out, disk)
        assert target.spec is not None
        fill_rate = _fill(target.spec.port, objects, size)
        target.stop()

        def restart(end: Callable[[Target], None]) -> dict[str, float | int]:
            target, seconds = _timed_start(out, disk)
            assert target.spec is not None
            good = _check_sample(target.spec.port, objects, size)
            end(target)
            load = max(seconds - baseline, 1e-3)
            return {"seconds": round(seconds, 3), "objects_per_s": round(objects / load), "sample_ok": good}

        clean = restart(_sigkill)  # loads the index a SIGTERM left; then dies without closing it
        unclean = restart(Target.stop)  # reads each segment above its watermark
        for index_file in disk.glob("index.sqlite3*"):
            index_file.unlink()
        rebuilt = restart(Target.stop)  # rebuilds the index from the record headers
    results = {
        "objects": objects,
        "object_size": size,
        "baseline_start_s": round(baseline, 3),
        "fill_objects_per_s": round(fill_rate),
        "clean_restart": clean,
        "after_sigkill": unclean,
        "index_rebuilt": rebuilt,
    }
    (out / "restart.json").write_text(json.dumps(results, indent=2))
    return results


def _sigkill(target: Target) -> None:
    proc = target.managed
    proc.kill()
    proc.wait(10)
    target.managed = None


def format_restart(results: dict[str, Any]) -> str:
    rows = [
        f"lmserver restart with {results['objects']:,} objects of {results['object_size']} B "
        "on its disk tier",
        f"(baseline start with an empty disk: {results['baseline_start_s']:.2f} s; "
        f"fill: {results['fill_objects_per_s']:,} PUT_ACKs/s)",
        "",
        "| restart | seconds to listening | index load rate (objects/s) | sample read back |",
        "|---|---|---|---|",
    ]
    for name in ("clean_restart", "after_sigkill", "index_rebuilt"):
        r = results[name]
        label = name.replace("_", " ")
        rows.append(f"| {label} | {r['seconds']:.2f} | {r['objects_per_s']:,} | {r['sample_ok']}/200 |")
    return "\n".join(rows)
