"""Client processes: one worker function for every target, parametrised by a driver.

Strategy: a pool of ``spawn``-ed processes lives for the whole run (spawning 16 Python
processes per cell would cost more than the cell). For each cell the parent sends every
participating worker a ``CellSpec``; each one connects, builds its request headers,
optionally preloads its keys, then waits on the barrier for that client count (the parent is
one of the parties, so it can sample server CPU exactly when the timed part starts). Each
worker then runs until its deadline or op cap, and sends back a ``ClientResult`` with its
own start/end clock readings (``perf_counter_ns`` is CLOCK_MONOTONIC, shared by all
processes on Linux) and one latency sample per batch.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import random
import threading
import time
import traceback
from array import array
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .drivers import Driver, RawDriver, TargetSpec, bench_key, make_driver

BARRIER_TIMEOUT = 60.0


@dataclass(frozen=True)
class CellSpec:
    target: TargetSpec
    op: str  # put, get, exist, mixed, stream_put, stream_get
    size: int
    depth: int  # requests per batch: 1 = sequential (the effective depth, see cli.PIPE_BYTES)
    keys: int  # keys per client
    duration: float
    max_ops: int
    clients: int
    preload: bool = False
    seed: int = 0
    put_ratio: float = 0.1  # mixed only


@dataclass
class ClientResult:
    cid: int
    ops: int = 0
    hits: int = 0
    nbytes: int = 0
    errors: int = 0
    start_ns: int = 0
    end_ns: int = 0
    lat_ns: array = field(default_factory=lambda: array("q"))
    error: str | None = None


_BUFFERS: dict[int, tuple[memoryview, memoryview]] = {}


def _buffers(size: int) -> tuple[memoryview, memoryview]:
    """Pre-touched (body, destination) buffers, reused across cells of the same size."""
    if size not in _BUFFERS:
        _BUFFERS.clear()
        pair = []
        for _ in range(2):
            buf = bytearray(size)
            for i in range(0, size, 4096):
                buf[i] = (i >> 12) & 0xFF
            pair.append(memoryview(buf))
        _BUFFERS[size] = (pair[0], pair[1])
    return _BUFFERS[size]


PRELOAD_SECONDS = 30.0


def _preload(driver: Driver, n_keys: int, body: memoryview) -> None:
    """Store every key once, acknowledged, in pipelined batches (<= 16 deep, <= 64 MiB)."""
    step = max(1, min(16, (64 << 20) // max(1, len(body))))
    end = time.monotonic() + PRELOAD_SECONDS
    for first in range(0, n_keys, step):
        driver.put(list(range(first, min(n_keys, first + step))), body)
        if time.monotonic() > end:
            break


def _run_cell(cid: int, spec: CellSpec, barrier: Any) -> ClientResult:
    res = ClientResult(cid)
    driver: Driver | None = None
    try:
        driver = make_driver(spec.target)
        keys = [bench_key(cid, spec.size, j) for j in range(spec.keys)]
        driver.prepare(keys, spec.size)
        body, dest = _buffers(spec.size)
        if spec.preload:
            _preload(driver, spec.keys, body)
    except Exception as exc:
        res.error = f"setup: {exc!r}"
        driver = None
    try:
        barrier.wait(BARRIER_TIMEOUT)
    except threading.BrokenBarrierError:
        res.error = res.error or "barrier broken"
    if driver is None or res.error:
        if driver is not None:
            driver.close()
        return res
    try:
        _timed(driver, spec, res, body, dest)
    except Exception as exc:
        res.error = f"{spec.op}: {exc!r}"
        res.end_ns = time.perf_counter_ns()
    finally:
        driver.close()
    return res


def _timed(driver: Driver, spec: CellSpec, res: ClientResult, body: memoryview, dest: memoryview) -> None:
    lat = res.lat_ns
    clock = time.perf_counter_ns
    n_keys = spec.keys
    depth = spec.depth
    res.start_ns = start = clock()
    deadline = start + int(spec.duration * 1e9)
    ops = hits = nbytes = 0
    size = spec.size
    if spec.op == "stream_put":
        assert isinstance(driver, RawDriver)
        ops = driver.stream_put(body, driver.put_hdr[0], deadline, spec.max_ops)
        res.end_ns = clock()
        res.ops = res.hits = ops
        res.nbytes = ops * size
        return
    if spec.op == "stream_get":
        assert isinstance(driver, RawDriver)
        ops = driver.stream_get(dest, deadline, spec.max_ops)
        res.end_ns = clock()
        res.ops = res.hits = ops
        res.nbytes = ops * size
        return
    batches = [[(b * depth + i) % n_keys for i in range(depth)] for b in range(max(1, n_keys))]
    nb = len(batches)
    b = 0
    now = start
    if spec.op == "put":
        fn = driver.put if depth == 1 else driver.put_pipelined
        while ops < spec.max_ops and now < deadline:
            t0 = now
            hits += fn(batches[b], body)
            now = clock()
            lat.append(now - t0)
            ops += depth
            b = (b + 1) % nb
        nbytes = ops * size
    elif spec.op == "get":
        get = driver.get
        while ops < spec.max_ops and now < deadline:
            t0 = now
            h, n = get(batches[b], dest)
            now = clock()
            lat.append(now - t0)
            hits += h
            nbytes += n
            ops += depth
            b = (b + 1) % nb
    elif spec.op == "exist":
        exist = driver.exist
        while ops < spec.max_ops and now < deadline:
            t0 = now
            hits += exist(batches[b])
            now = clock()
            lat.append(now - t0)
            ops += depth
            b = (b + 1) % nb
    elif spec.op == "mixed":
        rng = random.Random(spec.seed * 1009 + res.cid)
        plan = [(rng.random() < spec.put_ratio, rng.randrange(n_keys)) for _ in range(4096)]
        put = driver.put
        get = driver.get
        k = 0
        while ops < spec.max_ops and now < deadline:
            is_put, i = plan[k]
            k = (k + 1) & 4095
            t0 = now
            if is_put:
                hits += put([i], body)
                nbytes += size
            else:
                h, n = get([i], dest)
                hits += h
                nbytes += n
            now = clock()
            lat.append(now - t0)
            ops += 1
    else:
        raise ValueError(f"unknown op {spec.op}")
    res.end_ns = now
    res.ops = ops
    res.hits = hits
    res.nbytes = nbytes
    res.errors = 0


def client_main(cid: int, conn: Connection, barriers: dict[int, Any]) -> None:
    """Worker process loop: run cells sent by the parent until it sends None."""
    while True:
        try:
            spec = conn.recv()
        except EOFError:
            return
        if spec is None:
            return
        try:
            res = _run_cell(cid, spec, barriers[spec.clients])
        except Exception:
            res = ClientResult(cid, error=traceback.format_exc(limit=3))
        conn.send(res)


class ClientPool:
    """``max(clients)`` spawned worker processes and one barrier per client count."""

    def __init__(self, counts: list[int]) -> None:
        self.ctx = mp.get_context("spawn")
        self.counts = sorted(set(counts))
        self.size = max(self.counts)
        self.barriers = {c: self.ctx.Barrier(c + 1) for c in self.counts}
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        for cid in range(self.size):
            parent, child = self.ctx.Pipe()
            p = self.ctx.Process(
                target=client_main, args=(cid, child, self.barriers), name=f"bench-client-{cid}", daemon=True
            )
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)

    def run(self, spec: CellSpec, on_start: Any = None) -> tuple[list[ClientResult], str | None]:
        """Run one cell on ``spec.clients`` workers. ``on_start`` is called when the barrier trips."""
        n = spec.clients
        for cid in range(n):
            self.conns[cid].send(spec)
        barrier = self.barriers[n]
        problem = None
        try:
            barrier.wait(BARRIER_TIMEOUT + 10)
        except threading.BrokenBarrierError:
            problem = "barrier broken"
            barrier.reset()
        if on_start is not None and problem is None:
            on_start()
        limit = time.monotonic() + spec.duration + 120.0
        results: list[ClientResult] = []
        for cid in range(n):
            remaining = max(0.0, limit - time.monotonic())
            if self.conns[cid].poll(remaining):
                results.append(self.conns[cid].recv())
            else:
                problem = f"client {cid} did not finish in time"
                results.append(ClientResult(cid, error=problem))
        if problem is not None and problem != "barrier broken":
            self._restart()
        return results, problem

    def _restart(self) -> None:
        """A worker is stuck: end only our own worker processes and start a fresh pool."""
        for p in self.procs:
            p.kill()
            p.join(5)
        self.__init__(self.counts)  # type: ignore[misc]

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(OSError, BrokenPipeError):
                c.send(None)
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(2)
