"""``python -m bench run``: the whole benchmark as one command.

Strategy: the run goes target by target (one server alive at a time, so they never compete
for the two CPUs): first the physical-limit peer and the raw disk, then each server, in the
same process pool with the same worker code. Each target runs the same matrix
(object size x client count x workload); every cell is bounded by a duration and an op cap.
Results are summarised as they arrive, ratios are added at the end, and the table, JSON and
plots are written to the output folder (and, for full runs, copied to ``bench/latest``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from . import report
from .physdisk import disk_limit
from .targets import (
    REPO,
    Target,
    disk_dir_usage,
    given_target,
    prime_store,
    server_sample,
    start_lmserver,
    start_raw,
    start_redis_local,
)
from .worker import CellSpec, ClientPool

ALL_OPS = ("put", "get", "exist", "mixed")
PIPE_BYTES = 64 << 20
"""A pipelined batch carries at most this many body bytes: 32 MiB objects go 2 deep, not 16."""
LATEST = REPO / "bench" / "latest"


def _csv(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run the benchmark")
    r.add_argument("--smoke", action="store_true", help="tiny sizes and counts: a few seconds in all")
    r.add_argument(
        "--targets",
        default="lmserver,redis-local",
        help="comma list of: lmserver, redis-local, lm://HOST:PORT[?v=0|1], redis://HOST:PORT "
        "(the physical limit always runs; 'none' runs only that)",
    )
    r.add_argument("--sizes", help="object sizes, e.g. 64K,1M,4M,32M (smoke: 4K,64K)")
    r.add_argument("--clients", help="client process counts, e.g. 1,4,16 (smoke: 1,2)")
    r.add_argument("--ops", default=",".join(ALL_OPS), help="subset of put,get,exist,mixed")
    r.add_argument("--depth", type=int, default=16, help="pipeline depth (requests per batch)")
    r.add_argument("--duration", type=float, help="seconds per cell (default 0.6; smoke 0.05)")
    r.add_argument("--max-ops", type=int, help="op cap per client per cell (default 1e6; smoke 400)")
    r.add_argument("--key-budget", help="bytes of distinct keys per size and client count (default 256M)")
    r.add_argument("--variants", default="mem,disk", help="lmserver variants: mem, disk")
    r.add_argument("--memory-limit", default="8GiB", help="lmserver --memory-limit, memory-only variant")
    r.add_argument("--disk-memory-limit", default="128MiB", help="lmserver --memory-limit with the disk tier")
    r.add_argument("--disk-limit", default="8GiB", help="lmserver --disk-limit")
    r.add_argument("--disk-dir", help="folder for the disk tier and the raw disk limit (default: a temp dir)")
    r.add_argument("--lmserver-cmd", help="command that starts lmserver instead of 'python -m lmserver'")
    r.add_argument("--lmserver-args", default="", help="extra flags for lmserver, e.g. '--fsync always'")
    r.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>)")
    r.add_argument("--no-latest", action="store_true", help="do not copy results to bench/latest")
    r.add_argument("--no-plots", action="store_true")
    rs = sub.add_parser("restart", help="time lmserver restarts with many objects on its disk tier")
    rs.add_argument("--objects", type=int, default=100_000, help="objects to store before restarting")
    rs.add_argument("--size", type=int, default=1024, help="bytes per object")
    rs.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>-restart)")
    rs.add_argument("--no-latest", action="store_true", help="do not copy restart.json to bench/latest")
    sg = sub.add_parser("stream-get", help="GET latency on a socket that also streams PUTs, memory vs disk")
    sg.add_argument("--size", default="4M", help="PUT object size (default 4M)")
    sg.add_argument("--every", type=int, default=4, help="one GET after every N PUTs")
    sg.add_argument("--duration", type=float, default=5.0, help="seconds of streaming per target")
    sg.add_argument("--disk-args", default="--fsync never", help="extra lmserver flags with --disk")
    sg.add_argument("--lmserver-cmd", help="command that starts lmserver instead of 'python -m lmserver'")
    sg.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>-streamget)")
    lc = sub.add_parser("lmcache", help="LMCache RemoteBackend: built-in lm:// connector vs lmclient plugin")
    lc.add_argument("--chunks", type=int, default=200, help="KV chunks stored, looked up and retrieved")
    lc.add_argument("--chunk-size", default="4M", help="bytes per chunk")
    lc.add_argument("--rounds", type=int, default=3, help="rounds, each way once a round (medians)")
    lc.add_argument("--lookups", type=int, default=20, help="prefix lookups timed per round")
    lc.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>-lmcache)")
    lc.add_argument("--no-latest", action="store_true", help="do not copy lmcache.json/md to bench/latest")
    l2 = sub.add_parser(
        "lmcache-l2", help="LMCache multi-process L2 adapters: lmserver vs resp (Redis) vs fs"
    )
    l2.add_argument("--sizes", default="256K,4M,32M", help="chunk sizes")
    l2.add_argument("--chunks", default="64,64,16", help="chunks per size, in the order of --sizes")
    l2.add_argument(
        "--rounds", type=int, default=3, help="rounds, each adapter once a round (medians, ranges)"
    )
    l2.add_argument(
        "--lookups", type=int, default=32, help="lookup-and-lock tasks of 16 keys timed per round"
    )
    l2.add_argument("--adapters", default="lmserver,resp,fs", help="which of lmserver, resp, fs")
    l2.add_argument(
        "--params", default="{}", help="JSON: the lmserver adapter's adapter_params beyond its url"
    )
    l2.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>-lmcache-l2)")
    l2.add_argument("--no-latest", action="store_true", help="do not copy lmcache_l2.json/md to bench/latest")
    fl = sub.add_parser("fleet", help="a fleet on a namespace network: throughput, replace, dead host")
    fl.add_argument("--tier", choices=("s3", "hf"), default="s3", help="shared tier (s3: NIXL OBJ + moto)")
    fl.add_argument("--link-rate", default="1gbit", help="each server host's link (tc rate; 0: unshaped)")
    fl.add_argument("--size", default="1M", help="object size")
    fl.add_argument("--objects", type=int, default=64, help="objects per client in the throughput rounds")
    fl.add_argument("--clients", type=int, default=3, help="client processes in the throughput rounds")
    fl.add_argument("--rounds", type=int, default=3, help="throughput rounds (the server counts rotate)")
    fl.add_argument("--baseline", help="another checkout whose lmclient also runs the dead-host cases")
    fl.add_argument("--parts", default="throughput,replace,dead-host", help="which measurements to run")
    fl.add_argument("--smoke", action="store_true", help="tiny sizes and counts, small timeout only")
    fl.add_argument("--out", help="output folder (default bench/results/<UTC timestamp>-fleet)")
    fl.add_argument("--no-latest", action="store_true", help="do not copy fleet.json/md to bench/latest")
    return ap


def lmcache_l2(args: argparse.Namespace) -> int:
    from .lmcache_l2 import format_lmcache_l2, run_lmcache_l2_bench

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{stamp}-lmcache-l2"
    sizes = [report.parse_size(s) for s in _csv(args.sizes)]
    counts = [int(c) for c in _csv(args.chunks)]
    if len(counts) != len(sizes):
        raise SystemExit("--chunks needs one count per --sizes entry")
    chunks = dict(zip(sizes, counts, strict=True))
    params = json.loads(args.params)
    doc = run_lmcache_l2_bench(sizes, chunks, args.rounds, args.lookups, _csv(args.adapters), out, params)
    _report(out, "lmcache_l2", format_lmcache_l2(doc), latest=not args.no_latest)
    return 0


def _report(out: Path, name: str, text: str, latest: bool) -> None:
    """Print ``text``, write it as ``out/NAME.md`` beside ``out/NAME.json``, and copy both to
    bench/latest unless told not to."""
    (out / f"{name}.md").write_text(text + "\n")
    print(text)
    if latest:
        LATEST.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".md"):
            shutil.copy2(out / f"{name}{suffix}", LATEST / f"{name}{suffix}")


def fleet(args: argparse.Namespace) -> int:
    from .fleet import format_fleet, options_from, run_fleet

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{stamp}-fleet"
    results = run_fleet(options_from(args))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fleet.json").write_text(json.dumps(results, indent=2) + "\n")
    _report(out, "fleet", format_fleet(results), latest=not args.no_latest and not args.smoke)
    return 0


def stream_get(args: argparse.Namespace) -> int:
    from .streamget import format_stream_get, run_stream_get

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{stamp}-streamget"
    size = report.parse_size(args.size)
    variants = [
        ("lmserver", []),
        ("lmserver+disk", ["--disk", "{tmp}/disk", "--disk-limit", "64GiB", *args.disk_args.split()]),
    ]
    results = run_stream_get(size, args.every, args.duration, out, variants, args.lmserver_cmd)
    print(format_stream_get(results, size, args.every))
    return 0


def restart(args: argparse.Namespace) -> int:
    from .restart import format_restart, run_restart

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{stamp}-restart"
    results = run_restart(args.objects, args.size, out)
    print(format_restart(results))
    if not args.no_latest:
        LATEST.mkdir(parents=True, exist_ok=True)
        shutil.copy2(out / "restart.json", LATEST / "restart.json")
        (LATEST / "restart.md").write_text(format_restart(results) + "\n")
    return 0


def measure_cell(pool: ClientPool, target: Target, spec: CellSpec) -> tuple[dict[str, Any], str | None]:
    """Run one cell: the clients' summary (report.summarize_cell) with the server's CPU and
    RSS over it, and the pool's problem if any."""
    before: list[tuple[float, int] | None] = [None]

    def on_start() -> None:
        before[0] = server_sample(target.pid)

    results, problem = pool.run(spec, on_start)
    after = server_sample(target.pid)
    cell = report.summarize_cell(results, spec.size)
    cpu = after[0] - before[0][0] if after and before[0] else None
    cell["server_cpu_s"] = cpu
    cell["server_rss_bytes"] = after[1] if after else None
    moved = cell["bytes"] or 0
    cell["cpu_s_per_gb"] = cpu / (moved / 1e9) if cpu is not None and moved >= 1e6 else None
    cell["cpu_us_per_op"] = cpu / cell["ops"] * 1e6 if cpu is not None and cell["ops"] else None
    return cell, problem


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        smoke = args.smoke
        self.sizes = [
            report.parse_size(s) for s in _csv(args.sizes or ("4K,64K" if smoke else "64K,1M,4M,32M"))
        ]
        self.clients = sorted({int(c) for c in _csv(args.clients or ("1,2" if smoke else "1,4,16"))})
        self.ops = [o for o in _csv(args.ops) if o in ALL_OPS]
        self.depth = max(2, args.depth)
        self.duration = args.duration if args.duration is not None else (0.05 if smoke else 0.6)
        self.max_ops = args.max_ops if args.max_ops is not None else (400 if smoke else 1_000_000)
        self.key_budget = report.parse_size(args.key_budget or ("2M" if smoke else "256M"))
        self.cells: list[dict[str, Any]] = []
        self.memory: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.targets: list[Target] = []
        self.raw: Target | None = None

    def keys_per_client(self, size: int, clients: int) -> int:
        return max(1, min(512, self.key_budget // (size * clients)))

    def matrix(self, phys: bool) -> list[tuple[str, int]]:
        m: list[tuple[str, int]] = [("stream_put", 1), ("stream_get", 1)] if phys else []
        for op in self.ops:
            m.append((op, 1))
            if op != "mixed":
                m.append((op, self.depth))
        return m

    def run_target(self, pool: ClientPool, target: Target, disk_dir: Path | None = None) -> None:
        assert target.spec is not None
        phys = target.name == "phys"
        base = server_sample(target.pid)
        stored: set[tuple[int, int, int]] = set()
        for size in self.sizes:
            rnd = "phys" if phys else f"{target.name}:{size}"
            if not phys and self.raw is not None and self.raw.spec is not None:
                self.run_streams(pool, size, rnd)
            for n in self.clients:
                k = self.keys_per_client(size, n)
                preloaded = False
                for op, depth in self.matrix(phys):
                    preload = not preloaded and op in ("get", "exist", "mixed")
                    preloaded = preloaded or preload
                    capped = op in ("put", "get") and depth > 1
                    eff = max(2, min(depth, PIPE_BYTES // size)) if capped else depth
                    spec = CellSpec(
                        target=target.spec,
                        op=op,
                        size=size,
                        depth=eff,
                        keys=k,
                        duration=self.duration,
                        max_ops=self.max_ops,
                        clients=n,
                        preload=preload,
                        seed=len(self.cells),
                    )
                    self.run_cell(pool, target, spec, depth, rnd)
                    if op == "put" or preload:
                        stored.update((size, cid, j) for cid in range(n) for j in range(k))
            if base is not None and not phys:
                now = server_sample(target.pid)
                stored_bytes = sum(s for s, _c, _j in stored)
                rec: dict[str, Any] = {
                    "target": target.name,
                    "size": size,
                    "stored_bytes": stored_bytes,
                    "rss_bytes": now[1] if now else None,
                    "rss_growth_bytes": now[1] - base[1] if now else None,
                }
                rec["rss_per_gb_stored"] = (
                    rec["rss_growth_bytes"] / stored_bytes if now and stored_bytes else None
                )
                if disk_dir is not None:
                    rec["disk_bytes"] = disk_dir_usage(disk_dir)
                self.memory.append(rec)

    def run_store(self, pool: ClientPool) -> None:
        """The store limit: the raw peer writing each PUT into, and answering each GET from,
        the next of many cold buffers."""
        ops = [op for op in ("put", "get") if op in self.ops]
        if not ops:
            return
        # As many distinct buffers as the servers get distinct keys (--key-budget per size).
        store = start_raw("store", self.key_budget)
        self.targets.append(store)
        try:
            if store.spec is None:
                return
            for size in self.sizes:
                prime_store(store.spec.host, store.spec.port, size)  # builds its ring, untimed
                for n, op in itertools.product(self.clients, ops):
                    for depth in (1, self.depth):
                        eff = max(2, min(depth, PIPE_BYTES // size)) if depth > 1 else 1
                        spec = CellSpec(
                            target=store.spec,
                            op=op,
                            size=size,
                            depth=eff,
                            keys=self.keys_per_client(size, n),
                            duration=self.duration,
                            max_ops=self.max_ops,
                            clients=n,
                            preload=False,
                            seed=len(self.cells),
                        )
                        self.run_cell(pool, store, spec, depth, "store")
        finally:
            store.stop()

    def run_streams(self, pool: ClientPool, size: int, rnd: str) -> None:
        """Measure the loopback limit again right before a target's block of one object size.

        The host is shared and noisy; ratios use the limit measured closest in time.
        """
        assert self.raw is not None and self.raw.spec is not None
        for n in self.clients:
            for op in ("stream_put", "stream_get"):
                spec = CellSpec(self.raw.spec, op, size, 1, 1, self.duration, self.max_ops, n)
                self.run_cell(pool, self.raw, spec, 1, rnd)

    def run_cell(self, pool: ClientPool, target: Target, spec: CellSpec, depth: int, rnd: str) -> None:
        cell: dict[str, Any] = {
            "target": target.name,
            "op": spec.op,
            "depth": depth,
            "depth_effective": spec.depth,
            "round": rnd,
            "size": spec.size,
            "clients": spec.clients,
            "keys_per_client": spec.keys,
        }
        measured, problem = measure_cell(pool, target, spec)
        cell.update(measured)
        if problem:
            cell["problem"] = problem
            self.notes.append(f"{target.name} {spec.op} {spec.size} x{spec.clients}: {problem}")
        self.cells.append(cell)

    def disk_variant_dir(self) -> Path:
        if self.args.disk_dir:
            d = Path(self.args.disk_dir)
            d.mkdir(parents=True, exist_ok=True)
            return Path(tempfile.mkdtemp(prefix="lmbench-", dir=d))
        return Path(tempfile.mkdtemp(prefix="lmbench-"))

    def main(self, out: Path) -> dict[str, Any]:
        t_start = time.monotonic()
        load_start = os.getloadavg()
        args = self.args
        names = _csv(args.targets)
        variants = _csv(args.variants)
        want_disk = "lmserver" in names and "disk" in variants
        disk_dir = self.disk_variant_dir() if want_disk else None
        disk_rows: list[dict[str, Any]] = []
        pool = ClientPool(self.clients)
        try:
            self.raw = raw = start_raw()
            self.targets.append(raw)
            if raw.spec is not None:
                self.run_target(pool, raw)
            self.run_store(pool)
            if disk_dir is not None:
                budget = report.parse_size("4M" if args.smoke else "192M")
                for size in self.sizes:
                    disk_rows.append(disk_limit(disk_dir, size, budget, time_cap=1.0 if args.smoke else 4.0))
            for name in names:
                if name == "none":
                    continue
                self.run_named(pool, name, out, variants, disk_dir)
        finally:
            if self.raw is not None:
                self.raw.stop()
            pool.close()
            if disk_dir is not None:
                shutil.rmtree(disk_dir, ignore_errors=True)
        report.compute_ratios(self.cells)
        vm = psutil.virtual_memory()
        return {
            "meta": {
                "started": self.started,
                "host": platform.node(),
                "cpus": os.cpu_count(),
                "mem_gib": vm.total / 2**30,
                "python": platform.python_version(),
                "platform": platform.platform(),
                "smoke": bool(args.smoke),
                "sizes": self.sizes,
                "clients": self.clients,
                "ops": self.ops,
                "depth": self.depth,
                "duration_s": self.duration,
                "max_ops": self.max_ops,
                "key_budget": self.key_budget,
                "argv": sys.argv[1:],
                "elapsed_s": time.monotonic() - t_start,
                "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
            },
            "targets": [t.describe() for t in self.targets],
            "notes": self.notes,
            "disk_limit": disk_rows,
            "memory": self.memory,
            "cells": self.cells,
        }

    def run_named(
        self, pool: ClientPool, name: str, out: Path, variants: list[str], disk_dir: Path | None
    ) -> None:
        args = self.args
        extra_args = shlex.split(args.lmserver_args)
        if name == "lmserver":
            for v in variants:
                if v == "mem":
                    t = start_lmserver("lmserver", out, args.lmserver_cmd, extra_args, args.memory_limit)
                    self._run_and_stop(pool, t)
                elif v == "disk" and disk_dir is not None:
                    tier = disk_dir / "tier"
                    tier.mkdir(exist_ok=True)
                    extra = ["--disk", str(tier), "--disk-limit", args.disk_limit, *extra_args]
                    t = start_lmserver("lmserver+disk", out, args.lmserver_cmd, extra, args.disk_memory_limit)
                    self._run_and_stop(pool, t, tier)
                    shutil.rmtree(tier, ignore_errors=True)
                else:
                    self.notes.append(f"unknown lmserver variant {v!r} ignored")
        elif name == "redis-local":
            self._run_and_stop(pool, start_redis_local(out))
        elif name.startswith(("lm://", "redis://")):
            self._run_and_stop(pool, given_target(name))
        else:
            self.notes.append(f"unknown target {name!r} ignored")

    def _run_and_stop(self, pool: ClientPool, target: Target, disk_dir: Path | None = None) -> None:
        self.targets.append(target)
        if target.spec is None:
            self.notes.append(f"{target.name}: {target.note}")
            return
        try:
            self.run_target(pool, target, disk_dir)
        finally:
            target.stop()

    started = ""


def lmcache(args: argparse.Namespace) -> int:
    from .lmcache_engine import format_lmcache, run_lmcache_bench

    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"{stamp}-lmcache"
    doc = run_lmcache_bench(args.chunks, report.parse_size(args.chunk_size), args.rounds, args.lookups, out)
    _report(out, "lmcache", format_lmcache(doc), latest=not args.no_latest)
    return 0


def run(args: argparse.Namespace) -> int:
    started = dt.datetime.now(dt.UTC)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / started.strftime("%Y%m%dT%H%M%SZ")
    out.mkdir(parents=True, exist_ok=True)
    runner = Runner(args)
    runner.started = started.isoformat(timespec="seconds")
    doc = runner.main(out)
    report.write_json(doc, out / "results.json")
    md = report.render_markdown(doc)
    (out / "table.md").write_text(md + "\n")
    plots = [] if args.no_plots else report.plot_all(doc, out)
    print(report.side_by_side(doc["cells"]))
    if doc["disk_limit"]:
        print()
        print(report.disk_table(doc["disk_limit"]))
    if doc["memory"]:
        print()
        print(report.memory_table(doc["memory"]))
    for n in doc["notes"]:
        print(f"note: {n}")
    if not args.smoke and not args.no_latest:
        LATEST.mkdir(parents=True, exist_ok=True)
        for f in [out / "results.json", out / "table.md", *plots]:
            shutil.copy2(f, LATEST / f.name)
    print(f"\nresults: {out} ({doc['meta']['elapsed_s']:.0f} s)")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "run":
        with contextlib.suppress(KeyboardInterrupt):
            return run(args)
        return 130
    if args.cmd == "restart":
        return restart(args)
    if args.cmd == "stream-get":
        return stream_get(args)
    if args.cmd == "lmcache":
        return lmcache(args)
    if args.cmd == "lmcache-l2":
        return lmcache_l2(args)
    if args.cmd == "fleet":
        return fleet(args)
    return 2
