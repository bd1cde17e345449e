"""``python -m bench lmcache``: LMCache's RemoteBackend on lmserver, built-in lm:// connector
against the lmclient plugin, same server, same run.

Strategy: one lmserver; for each round and each way in (LMCache's built-in ``lm://``
connector, the ``lmclient.lmcache`` plugin, alternating which goes first), build what an
engine's LMCache builds (RemoteBackend over a LocalCPUBackend on the CPU), then time what the
engine does: store N chunks (``batched_submit_put_task``, until every put has finished),
look up their prefix (``batched_contains``, one call timed per repetition) and retrieve them
(``batched_get_blocking``; every chunk checked against what was stored once per round). A
third row drives lmclient's AsyncClient directly (``put_many``/``exists_many``/
``get_many_into`` into preallocated buffers): what the plugin could reach without LMCache's
own work. Needs LMCache installed (see .ci/run).
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from .targets import start_lmserver

WAYS = ("builtin", "plugin")


async def _drain() -> None:
    """Wait for every other task on this loop (the puts LMCache submitted)."""
    me = asyncio.current_task()
    while others := [task for task in asyncio.all_tasks() if task is not me]:
        await asyncio.wait(others)


class _Engine:
    """RemoteBackend + LocalCPUBackend on a private event-loop thread, as LMCache builds them."""

    def __init__(self, url: str, via: str, chunk_bytes: int, chunks: int) -> None:
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
        from lmcache.v1.storage_backend.remote_backend import RemoteBackend

        from lmclient.lmcache import plugin_settings

        tokens, hidden = 256, 512
        layers = max(1, chunk_bytes // (2 * tokens * hidden * 2))  # bfloat16 K and V
        self.shape = torch.Size([2, layers, tokens, hidden])
        settings: dict[str, Any] = {
            "chunk_size": tokens,
            "local_cpu": False,
            # stored chunks + retrieved ones, with room for the allocator's alignment
            "max_local_cpu_size": 2.5 * chunks * chunk_bytes / 1024**3 + 0.05,
            "remote_serde": "naive",
            "blocking_timeout_secs": 120,
        }
        if via == "plugin":
            settings.update(plugin_settings(url))
        else:
            settings["remote_url"] = url
        config = LMCacheEngineConfig.from_defaults(**settings)
        metadata = LMCacheMetadata(
            model_name=f"bench/{via}",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=torch.bfloat16,
            kv_shape=(layers, 2, tokens, 8, hidden // 8),
            chunk_size=tokens,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(config, metadata, dst_device="cpu")
        plugin = "lmserver" if via == "plugin" else None
        self.backend = RemoteBackend(config, metadata, self.loop, self.cpu, "cpu", plugin_name=plugin)

    def close(self) -> None:
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.cpu.close()


def _measure_engine(url: str, via: str, chunk_bytes: int, chunks: int, lookups: int) -> dict[str, Any]:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat

    engine = _Engine(url, via, chunk_bytes, chunks)
    try:
        model, dtype = f"bench/{via}", torch.bfloat16
        keys = [CacheEngineKey(model, 1, 0, i, dtype) for i in range(chunks)]
        objs = []
        for i in range(chunks):
            obj = engine.cpu.allocate(engine.shape, torch.bfloat16, MemoryFormat.KV_2LTD)
            assert obj is not None, "LocalCPUBackend is full"
            obj.tensor.fill_(i % 251)
            objs.append(obj)
        size = sum(len(obj.byte_array) for obj in objs)

        start = time.perf_counter()
        engine.backend.batched_submit_put_task(keys, objs)
        asyncio.run_coroutine_threadsafe(_drain(), engine.loop).result(600)
        store_s = time.perf_counter() - start
        for obj in objs:
            obj.ref_count_down()

        lookup_ms = []
        for _ in range(lookups):
            start = time.perf_counter()
            hits = engine.backend.batched_contains(keys)
            lookup_ms.append((time.perf_counter() - start) * 1e3)
            assert hits == chunks, f"{via}: prefix lookup found {hits} of {chunks}"

        start = time.perf_counter()
        got = engine.backend.batched_get_blocking(keys)
        retrieve_s = time.perf_counter() - start
        bad = sum(obj is None or int(obj.tensor[0, 0, 0, 0].item()) != i % 251 for i, obj in enumerate(got))
        for obj in got:
            if obj is not None:
                obj.ref_count_down()
        assert bad == 0, f"{via}: {bad} chunks missing or wrong"
        return _row(via, size, store_s, lookup_ms, retrieve_s)
    finally:
        engine.close()


def _measure_lmclient(url: str, chunk_bytes: int, chunks: int, lookups: int) -> dict[str, Any]:
    from lmclient import AsyncClient

    async def main() -> dict[str, Any]:
        blobs = [bytearray([i % 251]) * chunk_bytes for i in range(chunks)]
        outs = [bytearray(chunk_bytes) for _ in range(chunks)]
        keys = [f"bench/lmclient@1@0@{i:x}@bfloat16" for i in range(chunks)]
        async with AsyncClient.from_url(url) as client:
            start = time.perf_counter()
            await client.put_many(keys, blobs)
            store_s = time.perf_counter() - start
            lookup_ms = []
            for _ in range(lookups):
                start = time.perf_counter()
                assert all(await client.exists_many(keys))
                lookup_ms.append((time.perf_counter() - start) * 1e3)
            start = time.perf_counter()
            sizes = await client.get_many_into(keys, outs)
            retrieve_s = time.perf_counter() - start
        assert sizes == [chunk_bytes] * chunks and all(o[-1] == i % 251 for i, o in enumerate(outs))
        return _row("lmclient", chunk_bytes * chunks, store_s, lookup_ms, retrieve_s)

    return asyncio.run(main())


def _row(via: str, size: int, store_s: float, lookup_ms: list[float], retrieve_s: float) -> dict[str, Any]:
    ordered = sorted(lookup_ms)
    return {
        "via": via,
        "bytes": size,
        "store_gbps": size / store_s / 1e9,
        "retrieve_gbps": size / retrieve_s / 1e9,
        "lookup_p50_ms": statistics.median(ordered),
        "lookup_max_ms": ordered[-1],
    }


def run_lmcache_bench(chunks: int, chunk_bytes: int, rounds: int, lookups: int, out: Path) -> dict[str, Any]:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    out.mkdir(parents=True, exist_ok=True)
    # Each way overwrites its own keys every round: the server holds 3 x chunks at most.
    limit = f"{4 * chunks * chunk_bytes // 1024**2 + 256}MiB"
    target = start_lmserver("lmserver", out, None, [], limit)
    if target.spec is None:
        raise RuntimeError(f"lmserver did not start: {target.note}")
    url = f"lm://127.0.0.1:{target.spec.port}"
    rows: list[dict[str, Any]] = []
    try:
        for rnd in range(rounds):
            order = WAYS if rnd % 2 == 0 else tuple(reversed(WAYS))
            for via in order:
                rows.append({"round": rnd, **_measure_engine(url, via, chunk_bytes, chunks, lookups)})
            rows.append({"round": rnd, **_measure_lmclient(url, chunk_bytes, chunks, lookups)})
    finally:
        target.stop()
    doc = {"chunks": chunks, "chunk_bytes": chunk_bytes, "rounds": rounds, "lookups": lookups, "rows": rows}
    (out / "lmcache.json").write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def format_lmcache(doc: dict[str, Any]) -> str:
    """Median over rounds per way, and the plugin's ratio to the built-in connector."""
    ways = ["builtin", "plugin", "lmclient"]
    med: dict[str, dict[str, float]] = {}
    fields = ("store_gbps", "retrieve_gbps", "lookup_p50_ms", "lookup_max_ms")
    for way in ways:
        rows = [r for r in doc["rows"] if r["via"] == way]
        med[way] = {f: statistics.median(r[f] for r in rows) for f in fields}
    mib = doc["chunk_bytes"] / 1024**2
    lines = [
        f"LMCache RemoteBackend, {doc['chunks']} chunks of {mib:g} MiB, median of {doc['rounds']} rounds "
        f"({doc['lookups']} prefix lookups of all {doc['chunks']} keys each)",
        "",
        "| way | store GB/s | retrieve GB/s | lookup p50 ms | lookup max ms |",
        "|---|---|---|---|---|",
    ]
    names = {
        "builtin": "built-in lm:// connector",
        "plugin": "lmclient.lmcache plugin",
        "lmclient": "AsyncClient alone (no LMCache)",
    }
    for way in ways:
        m = med[way]
        lines.append(
            f"| {names[way]} | {m['store_gbps']:.2f} | {m['retrieve_gbps']:.2f} | "
            f"{m['lookup_p50_ms']:.2f} | {m['lookup_max_ms']:.2f} |"
        )
    ratios: dict[str, list[float]] = {"store_gbps": [], "retrieve_gbps": [], "lookup_p50_ms": []}
    for rnd in range(doc["rounds"]):
        pair = {r["via"]: r for r in doc["rows"] if r["round"] == rnd}
        if "builtin" in pair and "plugin" in pair:
            for field, values in ratios.items():
                values.append(pair["plugin"][field] / pair["builtin"][field])
    lines += [
        "",
        "plugin / built-in, per round, median (min-max): "
        f"store x{_spread(ratios['store_gbps'])}, retrieve x{_spread(ratios['retrieve_gbps'])}, "
        f"lookup latency x{_spread(ratios['lookup_p50_ms'], '.3f')}",
    ]
    return "\n".join(lines)


def _spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"
