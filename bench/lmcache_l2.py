"""``python -m bench lmcache-l2``: LMCache multi-process mode's L2 adapters, lmserver against
resp (Redis) and fs, each built by LMCache's own parser and factory, in one run.

Strategy: one lmserver (``--max-object-size`` above the largest chunk), one redis-server
(Debian's, persistence off) and an fs directory on the local disk (its loads come from the
page cache), all on loopback. Each adapter is built from its ``--l2-adapter`` JSON exactly as
``lmcache server`` builds it (``parse_args_to_l2_adapters_config`` then ``create_l2_adapter``)
and driven in the storage controllers' call pattern: every store task submitted at once (16
chunks a task, as the store controller groups them), then one lookup-and-lock task of 16 keys
at a time (timed from submit to result, then unlocked), then every load task at once into
separate L1-like buffers, each waited for on its eventfd. Every loaded chunk is checked
against what was stored. Each round uses fresh keys (fs skips a key it already holds) and
deletes them afterwards; rounds alternate which adapter goes first, so the host's drift
falls on both sides of each ratio. Ratios are taken within a round (lmserver / resp), then
their median and range over rounds. Needs LMCache installed; resp is skipped without
``redis-server`` on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .targets import Target, server_sample, start_lmserver, start_redis_local

BATCH = 16
"""Keys per store, lookup and load task (the reference measurements' batches)."""
ADAPTERS = ("lmserver", "resp", "fs")


def _spec(name: str, target: Target | None, fs_dir: Path, params: dict[str, Any]) -> dict[str, Any]:
    from lmclient.lmcache_mp import adapter_spec

    if name == "fs":
        return {"type": "fs", "base_path": str(fs_dir)}
    assert target is not None and target.spec is not None
    if name == "resp":
        return {"type": "resp", "host": "127.0.0.1", "port": target.spec.port}
    return adapter_spec(f"lm://127.0.0.1:{target.spec.port}", **params)


def _build(spec: dict[str, Any]) -> Any:
    """The adapter as LMCache's StorageManager builds it from ``--l2-adapter JSON``."""
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

    config = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)])).adapters[0]
    adapter = create_l2_adapter(config, None)
    adapter.set_backend_identity(spec["type"], shared=config.shared)
    return adapter


class _Buffers:
    """``count`` L1-like objects of ``size`` bytes in one 4096-aligned buffer (LMCache's
    MixedMemoryAllocator hands out such TensorMemoryObj views)."""

    def __init__(self, count: int, size: int) -> None:
        import torch
        from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

        backing = torch.empty(count * size + 4096, dtype=torch.uint8)
        offset = (-backing.data_ptr()) % 4096
        self.objs = []
        for i in range(count):
            raw = backing[offset + i * size : offset + (i + 1) * size]
            meta = MemoryObjMetadata(
                shape=torch.Size([size // 2]),
                dtype=torch.bfloat16,
                address=i * size,
                phy_size=size,
                fmt=MemoryFormat.KV_2LTD,
                ref_count=1,
            )
            self.objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))

    def fill(self, seed: int) -> None:
        for i, obj in enumerate(self.objs):
            obj.raw_data.fill_((seed + i) % 251)
            obj.raw_data[0] = (seed * 7 + i) % 256  # each chunk's first and last bytes differ

    def matches(self, seed: int) -> int:
        good = 0
        for i, obj in enumerate(self.objs):
            raw = obj.raw_data
            good += int(raw[-1]) == (seed + i) % 251 and int(raw[0]) == (seed * 7 + i) % 256
        return good


def _wait(fd: int, deadline: float) -> None:
    from lmcache.v1.platform import consume_fd

    poller = select.poll()
    poller.register(fd, select.POLLIN)
    if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
        raise TimeoutError("an L2 task did not complete in time")
    consume_fd(fd)


def _store(adapter: Any, keys: list[Any], objs: list[Any], timeout: float) -> float:
    deadline = time.monotonic() + timeout
    start = time.perf_counter()
    tasks = {
        adapter.submit_store_task(keys[i : i + BATCH], objs[i : i + BATCH])
        for i in range(0, len(keys), BATCH)
    }
    results = {}
    while len(results) < len(tasks):
        _wait(adapter.get_store_event_fd(), deadline)
        results.update(adapter.pop_completed_store_tasks())
    elapsed = time.perf_counter() - start
    if not all(results[t].is_successful() for t in tasks):
        raise RuntimeError("a store task failed")
    return elapsed


def _lookup(adapter: Any, keys: list[Any], repeats: int, timeout: float) -> list[float]:
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    layout = {0: MemoryLayoutDesc(shapes=[], dtypes=[])}
    fd, took = adapter.get_lookup_and_lock_event_fd(), []
    for r in range(repeats):
        batch = keys[(r * BATCH) % len(keys) :][:BATCH]
        deadline = time.monotonic() + timeout
        start = time.perf_counter()
        task = adapter.submit_lookup_and_lock_task(batch, layout)
        while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
            _wait(fd, deadline)
        took.append((time.perf_counter() - start) * 1e3)
        adapter.submit_unlock(batch)
        if bitmap.popcount() != len(batch):
            raise RuntimeError(f"lookup found {bitmap.popcount()} of {len(batch)}")
    return took


def _load(adapter: Any, keys: list[Any], objs: list[Any], timeout: float) -> tuple[float, int]:
    deadline = time.monotonic() + timeout
    start = time.perf_counter()
    pending = {
        adapter.submit_load_task(keys[i : i + BATCH], objs[i : i + BATCH]) for i in range(0, len(keys), BATCH)
    }
    loaded = 0
    while pending:
        _wait(adapter.get_load_event_fd(), deadline)
        for task in list(pending):
            bitmap = adapter.query_load_result(task)
            if bitmap is not None:
                loaded += bitmap.popcount()
                pending.discard(task)
    return time.perf_counter() - start, loaded


class _Cpu:
    """CPU seconds this process and the server (if any) use between `start` and `stop`:
    the adapters' own threads (resp's C++ workers included) and the server's whole process."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid
        self.client = self.server = 0.0

    def _now(self) -> tuple[float, float]:
        sample = server_sample(self.pid)
        return time.process_time(), sample[0] if sample else 0.0

    def __enter__(self) -> _Cpu:
        self._start = self._now()
        return self

    def __exit__(self, *exc: object) -> None:
        end = self._now()
        self.client, self.server = end[0] - self._start[0], end[1] - self._start[1]


def _measure(
    name: str,
    adapter: Any,
    server_pid: int | None,
    size: int,
    count: int,
    rnd: int,
    src: _Buffers,
    dst: _Buffers,
    lookups: int,
) -> dict[str, Any]:
    from lmcache.v1.distributed.api import ObjectKey

    model = f"bench/{name}"
    keys = [
        ObjectKey(chunk_hash=(rnd << 32 | i).to_bytes(32, "big"), model_name=model, kv_rank=0)
        for i in range(count)
    ]
    seed = rnd * 31 + size % 97
    src.fill(seed)
    for obj in dst.objs:
        obj.raw_data.zero_()
    timeout = 120.0
    try:
        with _Cpu(server_pid) as store_cpu:
            store_s = _store(adapter, keys, src.objs, timeout)
        lookup_ms = sorted(_lookup(adapter, keys, lookups, timeout))
        with _Cpu(server_pid) as load_cpu:
            load_s, loaded = _load(adapter, keys, dst.objs, timeout)
        verified = dst.matches(seed)
    finally:
        adapter.delete(keys)
    total = size * count
    return {
        "adapter": name,
        "round": rnd,
        "chunk_bytes": size,
        "chunks": count,
        "store_gbps": total / store_s / 1e9,
        "load_gbps": total / load_s / 1e9,
        "lookup_p50_ms": statistics.median(lookup_ms),
        "lookup_p99_ms": lookup_ms[min(len(lookup_ms) - 1, round(0.99 * (len(lookup_ms) - 1)))],
        "loaded": loaded,
        "verified": verified,
        # CPU microseconds per chunk: this process (client), the server process (0 for fs)
        "store_cpu_us": [store_cpu.client / count * 1e6, store_cpu.server / count * 1e6],
        "load_cpu_us": [load_cpu.client / count * 1e6, load_cpu.server / count * 1e6],
    }


@contextmanager
def _servers(out: Path, largest: int, count: int, want: list[str]) -> Iterator[dict[str, Target | None]]:
    targets: dict[str, Target | None] = {}
    try:
        if "lmserver" in want:
            limit = f"{3 * largest * count // 1024**2 + 512}MiB"
            extra = ["--max-object-size", str(max(largest, 1 << 20))]
            targets["lmserver"] = start_lmserver("lmserver", out, None, extra, limit)
        if "resp" in want:
            targets["resp"] = start_redis_local(out)
        yield targets
    finally:
        for target in targets.values():
            if target is not None:
                target.stop()


def run_lmcache_l2_bench(
    sizes: list[int],
    chunks: dict[int, int],
    rounds: int,
    lookups: int,
    want: list[str],
    out: Path,
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every adapter of ``want`` for each chunk size (``chunks[size]`` chunks), ``rounds``
    times; the results document (also written to ``out/lmcache_l2.json``). ``params``: the
    lmserver adapter's ``adapter_params`` beyond its url."""
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    out.mkdir(parents=True, exist_ok=True)
    fs_dir = out / "fs"
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    largest = max(sizes)
    with _servers(out, largest, max(chunks[s] for s in sizes), want) as targets:
        names = []
        for name in want:
            target = targets.get(name)
            if name != "fs" and (target is None or target.spec is None):
                notes.append(f"{name}: {target.note if target else 'not started'}")
                continue
            names.append(name)
        adapters = {name: _build(_spec(name, targets.get(name), fs_dir, params or {})) for name in names}
        try:
            for size in sizes:
                count = chunks[size]
                src, dst = _Buffers(count, size), _Buffers(count, size)
                for rnd in range(rounds):
                    order = names[rnd % len(names) :] + names[: rnd % len(names)]
                    for name in order:
                        target = targets.get(name)
                        pid = target.pid if target is not None else None
                        rows.append(_measure(name, adapters[name], pid, size, count, rnd, src, dst, lookups))
        finally:
            for adapter in adapters.values():
                adapter.close()
        versions = {n: t.extra.get("version", "") for n, t in targets.items() if t is not None and t.extra}
    doc = {"sizes": sizes, "chunks": {str(s): chunks[s] for s in sizes}, "rounds": rounds}
    doc |= {"lookups": lookups, "batch": BATCH, "lmserver_params": params or {}}
    doc |= {"rows": rows, "notes": notes, "versions": versions}
    (out / "lmcache_l2.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def _span(values: list[float], fmt: str = ".2f") -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def format_lmcache_l2(doc: dict[str, Any]) -> str:
    """Per chunk size and adapter: medians (ranges) over rounds; then lmserver / resp per round."""
    lines = [
        f"LMCache 0.5.6 L2 adapters through LMCache's factory, {doc['rounds']} rounds, tasks of "
        f"{doc['batch']} keys; lookup = one lookup-and-lock task of {doc['batch']} keys "
        f"({doc['lookups']} per round); "
        "median (min-max) over rounds",
        "",
        "| chunk | adapter | store GB/s | load GB/s | lookup p50 ms | lookup p99 ms | verified "
        "| CPU µs per chunk, client + server (all rounds): store / load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = doc["rows"]
    names = [n for n in ADAPTERS if any(r["adapter"] == n for r in rows)]
    for size in doc["sizes"]:
        label = f"{doc['chunks'][str(size)]} x {_size(size)}"
        for name in names:
            mine = [r for r in rows if r["adapter"] == name and r["chunk_bytes"] == size]
            if not mine:
                continue
            verified = f"{sum(r['verified'] for r in mine)}/{sum(r['chunks'] for r in mine)}"
            # Summed over the rounds: the OS counts a process's CPU in 10 ms ticks, coarse
            # against one round (64 chunks of 256 KiB move in ~20 ms).
            cpu = " / ".join(
                "{:.0f} + {:.0f}".format(*(sum(r[field][i] for r in mine) / len(mine) for i in (0, 1)))
                for field in ("store_cpu_us", "load_cpu_us")
            )
            lines.append(
                f"| {label} | {name} | {_span([r['store_gbps'] for r in mine])} | "
                f"{_span([r['load_gbps'] for r in mine])} | {_span([r['lookup_p50_ms'] for r in mine])} | "
                f"{_span([r['lookup_p99_ms'] for r in mine])} | {verified} | {cpu} |"
            )
    if "lmserver" in names and "resp" in names:
        lines += ["", "lmserver / resp, per round (median, range):", ""]
        lines += ["| chunk | store | load | lookup p50 (lower is better) |", "|---|---|---|---|"]
        for size in doc["sizes"]:
            ratios: dict[str, list[float]] = {"store_gbps": [], "load_gbps": [], "lookup_p50_ms": []}
            for rnd in range(doc["rounds"]):
                pair = {
                    r["adapter"]: r
                    for r in rows
                    if r["chunk_bytes"] == size and r["round"] == rnd and r["adapter"] in ("lmserver", "resp")
                }
                if len(pair) == 2:
                    for field in ratios:
                        ratios[field].append(pair["lmserver"][field] / pair["resp"][field])
            lines.append(
                f"| {_size(size)} | x{_span(ratios['store_gbps'])} | x{_span(ratios['load_gbps'])} | "
                f"x{_span(ratios['lookup_p50_ms'])} |"
            )
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _size(size: int) -> str:
    return f"{size // 1024**2} MiB" if size >= 1024**2 else f"{size // 1024} KiB"
