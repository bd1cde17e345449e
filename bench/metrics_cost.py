"""What serving /metrics costs the hot path: pipelined EXIST with and without --metrics-port.

    python -m bench.metrics_cost --seconds 3 --rounds 5
    python -m bench.metrics_cost --base-pythonpath /tmp/base   # also an older tree, same loop

Each variant is a fresh ``python -m lmserver`` on loopback; one client (this process)
pipelines ``--depth`` EXISTs per batch (half of the keys present) for ``--seconds``; with
metrics, a second process scrapes /metrics every second meanwhile. Variants alternate
round by round (A B A B ...) so load from other processes hits both alike; the medians of
kops/s and of server CPU µs per EXIST are printed with their ratio to the first variant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from typing import Any

import psutil

from .drivers import LmDriver, TargetSpec


def start(extra: list[str], pythonpath: str | None) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(f"{pythonpath}/{p}" for p in ("", "protocol", "clients"))
    cmd = [sys.executable, "-m", "lmserver", "--port", "0", "--log-format", "json", "--memory-limit", "1GiB"]
    # The tree's own folder as cwd: ``-m`` puts the cwd first on sys.path.
    proc = subprocess.Popen(
        [*cmd, *extra], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env, cwd=pythonpath
    )
    assert proc.stderr is not None
    for line in proc.stderr:
        event = json.loads(line)
        if event.get("event") == "listening":
            return proc, event
    raise RuntimeError("server did not start")


def scrape_forever(port: int) -> None:
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            response.read()
        time.sleep(1.0)


def run_one(
    extra: list[str], pythonpath: str | None, seconds: float, depth: int, keys: int
) -> tuple[float, float]:
    proc, info = start(extra, pythonpath)
    scraper = None
    try:
        if info.get("metrics_port"):
            port = info["metrics_port"]
            scraper = multiprocessing.Process(target=scrape_forever, args=(port,), daemon=True)
            scraper.start()
        driver = LmDriver(TargetSpec("lm", "127.0.0.1", int(info["port"]), put_ack=True))
        names = [f"cost-{i}" for i in range(keys)]
        driver.prepare(names, 16)
        driver.put(list(range(0, keys, 2)), memoryview(b"x" * 16))
        batches = [list(range(i, i + depth)) for i in range(0, keys - depth + 1, depth)]
        server = psutil.Process(proc.pid)
        cpu0 = sum(server.cpu_times()[:2])
        t0 = time.perf_counter()
        ops = 0
        while time.perf_counter() - t0 < seconds:
            for batch in batches:
                driver.exist(batch)
                ops += len(batch)
        elapsed = time.perf_counter() - t0
        cpu = sum(server.cpu_times()[:2]) - cpu0
        driver.close()
        return ops / elapsed / 1e3, cpu / ops * 1e6
    finally:
        if scraper is not None:
            scraper.terminate()
            scraper.join()
        proc.terminate()
        proc.wait(30)


class _Transport:
    """Just enough of a transport for LMProtocol's EXIST path (replies are dropped)."""

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else default

    def set_write_buffer_limits(self, high: int = 0, low: int = 0) -> None: ...
    def write(self, data: Any) -> None: ...
    def writelines(self, data: Any) -> None: ...
    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None: ...
    def resume_reading(self) -> None: ...


def in_process(depth: int, batches: int, rounds: int) -> float:
    """ns of server work per pipelined EXIST, LMProtocol driven directly (no sockets, no noise
    from the client): the hot path alone, the same way for any source tree on PYTHONPATH."""
    from lmproto import Command, Generation, encode_request
    from lmserver.config import ServerConfig
    from lmserver.connection import LMProtocol
    from lmserver.state import ServerState
    from lmserver.storage.memory import MemoryTier
    from lmserver.storage.store import Store

    config = ServerConfig(memory_limit=64 * 1024**2)
    state = ServerState(config=config, store=Store(MemoryTier(config.memory_limit)))
    protocol = LMProtocol(state)

    async def connect() -> None:  # connection_made reads the loop's clock
        protocol.connection_made(_Transport())  # type: ignore[arg-type]

    asyncio.run(connect())
    frames = b"".join(
        encode_request(Command.EXIST, f"key-{i}", generation=Generation.V0) for i in range(depth)
    )
    best = float("inf")
    for _ in range(rounds):
        t0 = time.thread_time_ns()  # CPU time of this thread: preemption by other load is not counted
        for _ in range(batches):
            view = protocol.get_buffer(-1)
            view[: len(frames)] = frames
            protocol.buffer_updated(len(frames))
        best = min(best, (time.thread_time_ns() - t0) / (batches * depth))
    return best


def scrape_cost(scrapes: int) -> tuple[float, float]:
    """ms per scrape of a server with 100 open connections: on the loop (snapshot), in all."""
    from lmserver.config import ServerConfig
    from lmserver.metrics import ServerCollector, snapshot
    from lmserver.server import Server

    async def measure() -> tuple[float, float]:
        server = Server(ServerConfig(port=0, memory_limit=64 * 1024**2, metrics_port=0))
        await server.start()
        socks = [await asyncio.open_connection(server.host, server.port) for _ in range(100)]
        await asyncio.sleep(0.2)
        collector = ServerCollector(server.state)
        t0 = time.perf_counter()
        for _ in range(scrapes):
            snapshot(server.state)
        on_loop = (time.perf_counter() - t0) / scrapes * 1e3
        from prometheus_client import generate_latest

        t0 = time.perf_counter()
        for _ in range(scrapes):
            generate_latest(server._metrics.renderer.registry)  # type: ignore[union-attr]
        total = (time.perf_counter() - t0) / scrapes * 1e3
        del collector
        for _, writer in socks:
            writer.close()
        await server.shutdown()
        return on_loop, total

    return asyncio.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--depth", type=int, default=256)
    parser.add_argument("--keys", type=int, default=4096)
    parser.add_argument("--base-pythonpath", help="also run this source tree (no metrics) as 'base'")
    parser.add_argument("--in-process", action="store_true", help="only the hot-path and scrape figures")
    args = parser.parse_args()
    if args.in_process:
        from lmserver.logs import configure_logging

        configure_logging("warning", "json")
        ns = in_process(args.depth, 400, args.rounds)
        print(f"hot path: {ns:.1f} ns per pipelined EXIST (depth {args.depth}, best of {args.rounds})")
        try:
            on_loop, total = scrape_cost(50)
        except ImportError:
            return  # a tree without metrics
        print(f"scrape with 100 connections: {on_loop:.2f} ms on the event loop, {total:.2f} ms in all")
        return
    variants: dict[str, tuple[list[str], str | None]] = {}
    if args.base_pythonpath:
        variants["base"] = ([], args.base_pythonpath)
    variants["off"] = ([], None)
    variants["metrics"] = (["--metrics-port", "0"], None)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, (extra, path) in variants.items():
            results[name].append(run_one(extra, path, args.seconds, args.depth, args.keys))
    first = next(iter(results))
    ref_kops = statistics.median(k for k, _ in results[first])
    ref_cpu = statistics.median(c for _, c in results[first])
    print(f"pipelined EXIST, depth {args.depth}, {args.rounds} rounds x {args.seconds}s, medians")
    print("variant   kops/s  ratio   srv CPU us/op  ratio   (all kops/s)")
    for name, runs in results.items():
        kops = statistics.median(k for k, _ in runs)
        cpu = statistics.median(c for _, c in runs)
        spread = " ".join(f"{k:.0f}" for k, _ in runs)
        print(f"{name:8} {kops:7.0f}  {kops / ref_kops:5.3f}  {cpu:13.3f}  {cpu / ref_cpu:5.3f}   ({spread})")


if __name__ == "__main__":
    main()
