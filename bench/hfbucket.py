"""``python -m bench.hfbucket``: the HF Buckets tier's demotion and promotion throughput
through a local fake Hub, and what it costs the event loop.

Strategy: the real ``HfApi`` and ``hf_xet`` run against the fake Hub of the tests
(``tests/fakehub``: stdlib HTTP for the Hub's JSON routes and for its storage service, in a
child process), so the figures are the client stack's cost on this machine, plus the fake's
own HTTP serving, not a network's.
For each object size:

* **raw**: the limit of that client stack, measured in the same run: one
  ``batch_bucket_files`` of the objects as bytes (upload), and hf_xet streaming each object
  into a preallocated buffer (download), with no tier around them.
* **demote**: ``HFBucketTier.put`` of every object, ``--concurrency`` at a time, as the
  Store's demotion queue drives it (spool file, batch commit, reconciliation).
* **promote**: ``HFBucketTier.get_into`` of every object into a preallocated buffer, with
  ``read=stream`` (straight into the buffer) and ``read=file`` (a temp file, then read).

The fake Hub runs in a child process. While the tier works, a ticker on the same event loop
sleeps 1 ms at a time and records how late each wake-up is: the loop lag (p50/p99/max; an
idle run of the ticker is the baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the fake Hub is test infrastructure

MiB = 1024 * 1024


class LagProbe:
    """Measures event-loop lag: how late 1 ms sleeps wake up while other work runs."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(0.001)
            self.lags.append(loop.time() - start - 0.001)

    def __enter__(self) -> LagProbe:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def summary(self) -> dict[str, float]:
        if not self.lags:
            return {"p50_ms": 0.0, "p99_ms": 0.0, "max_ms": 0.0}
        lags = sorted(self.lags)
        return {
            "p50_ms": round(statistics.median(lags) * 1000, 3),
            "p99_ms": round(lags[min(len(lags) - 1, int(len(lags) * 0.99))] * 1000, 3),
            "max_ms": round(lags[-1] * 1000, 3),
        }


async def _timed(work: Callable[[], Awaitable[Any]]) -> tuple[float, dict[str, float]]:
    with LagProbe() as probe:
        start = time.perf_counter()
        await work()
        seconds = time.perf_counter() - start
    return seconds, probe.summary()


async def _bounded(n: int, jobs: list[Callable[[], Awaitable[bool]]]) -> None:
    gate = asyncio.Semaphore(n)

    async def one(job: Callable[[], Awaitable[bool]]) -> None:
        async with gate:
            if not await job():
                raise RuntimeError("a tier operation failed")

    await asyncio.gather(*(one(job) for job in jobs))


async def bench_size(hub: Any, size: int, count: int, concurrency: int, root: Path) -> dict[str, Any]:
    import hf_xet
    from fakehub import TOKEN
    from huggingface_hub import HfApi

    bucket = f"bench/s{size}"
    blobs = [os.urandom(size) for _ in range(count)]
    total = size * count
    result: dict[str, Any] = {"size": size, "objects": count, "concurrency": concurrency}

    # Raw client stack: one batch upload of the bytes, then streamed downloads.
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    start = time.perf_counter()
    await asyncio.to_thread(
        api.batch_bucket_files, bucket, add=[(b, f"raw/{i}") for i, b in enumerate(blobs)]
    )
    result["raw_up_MBps"] = total / (time.perf_counter() - start) / 1e6
    infos = list(api.get_bucket_paths_info(bucket, [f"raw/{i}" for i in range(count)]))
    refresh = api.get_bucket_file_metadata(bucket, infos[0].path).xet_file_data.refresh_route
    group = hf_xet.XetSession().new_download_stream_group(
        token_refresh_url=refresh, token_refresh_headers={"authorization": f"Bearer {TOKEN}"}
    )
    buffers = [bytearray(size) for _ in range(concurrency)]

    def raw_download(i: int) -> None:
        info = infos[i]
        view = memoryview(buffers[i % concurrency])
        for offset, chunk in group.download_unordered_stream(hf_xet.XetFileInfo(info.xet_hash, info.size)):
            view[offset : offset + len(chunk)] = chunk

    async def raw_downloads() -> None:
        gate = asyncio.Semaphore(concurrency)

        async def one(i: int) -> None:
            async with gate:
                await asyncio.to_thread(raw_download, i)

        await asyncio.gather(*(one(i) for i in range(count)))

    seconds, _ = await _timed(raw_downloads)
    result["raw_down_MBps"] = total / seconds / 1e6

    for mode in ("stream", "file"):
        result.update(await _tier_pass(hub, bucket, mode, blobs, concurrency, root))
    return result


async def _tier_pass(
    hub: Any, bucket: str, mode: str, blobs: list[bytes], concurrency: int, root: Path
) -> dict[str, Any]:
    """Demote every blob through a ``read=stream`` tier (then promote them back), or promote
    them with a ``read=file`` tier on the same objects."""
    from fakehub import TOKEN

    from lmproto import ObjectMeta
    from lmserver.storage.tiers.hf import HFBucketTier, Options

    meta = ObjectMeta(1, 2, (1, 1, 1, 1), 0)
    size, total = len(blobs[0]), sum(len(b) for b in blobs)
    result: dict[str, Any] = {}
    options = Options(refresh_s=0.0, workers=concurrency, read_mode=mode, cache_dir=str(root / f"c-{mode}"))
    handle = f"hf://buckets/{bucket}/stream"  # both passes use the objects the stream pass wrote
    tier = HFBucketTier(handle, token=TOKEN, endpoint=hub.endpoint, options=options)
    await tier.open()
    try:
        if mode == "stream":
            puts = [functools.partial(tier.put, f"k{i}", memoryview(b), meta) for i, b in enumerate(blobs)]
            seconds, lag = await _timed(lambda: _bounded(concurrency, puts))
            result["demote_MBps"] = total / seconds / 1e6
            result["demote_lag"] = lag
            result["batches"] = tier.usage().counters["batches"]
        slots = [bytearray(size) for _ in range(concurrency)]
        free = list(range(concurrency))

        async def get(key: str) -> bool:
            slot = free.pop()
            try:
                return await tier.get_into(key, lambda n: memoryview(slots[slot])[:n]) is not None
            finally:
                free.append(slot)

        gets = [functools.partial(get, f"k{i}") for i in range(len(blobs))]
        seconds, lag = await _timed(lambda: _bounded(concurrency, gets))
        result[f"promote_{mode}_MBps"] = total / seconds / 1e6
        result[f"promote_{mode}_lag"] = lag
    finally:
        await tier.close()
    return result


class HubProcess:
    """The fake Hub in a child process, so its HTTP handling does not take the measured
    process's GIL (which would show up as event-loop lag that is not the tier's)."""

    def __init__(self, root: Path, buckets: list[str]) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fakehub", str(root), *buckets],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self.proc.stdout is not None
        self.endpoint = self.proc.stdout.readline().strip()
        if not self.endpoint.startswith("http://"):
            raise RuntimeError("the fake Hub did not start")

    def create(self, bucket: str) -> None:
        raise RuntimeError("buckets are created when the process starts")

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


async def run(sizes: list[int], total_bytes: int, concurrency: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="lmserver-bench-hf-") as tmp:
        root = Path(tmp)
        hub = HubProcess(root / "hub", [f"bench/s{size}" for size in sizes])
        try:
            idle = LagProbe()
            with idle:
                await asyncio.sleep(1.0)
            results = {
                "idle_lag": idle.summary(),
                "sizes": [
                    await bench_size(hub, size, max(2, total_bytes // size), concurrency, root)
                    for size in sizes
                ],
            }
        finally:
            hub.stop()
    return results


def format_table(results: dict[str, Any]) -> str:
    lines = [
        "| object | objects | raw up MB/s | demote MB/s (x raw) | raw down MB/s "
        "| promote stream MB/s (x raw) | promote file MB/s | loop lag p99 demote / promote ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["sizes"]:
        lines.append(
            f"| {r['size'] // MiB} MiB | {r['objects']} | {r['raw_up_MBps']:.0f} | {r['demote_MBps']:.0f} "
            f"({r['demote_MBps'] / r['raw_up_MBps']:.2f}) | {r['raw_down_MBps']:.0f} "
            f"| {r['promote_stream_MBps']:.0f} ({r['promote_stream_MBps'] / r['raw_down_MBps']:.2f}) "
            f"| {r['promote_file_MBps']:.0f} "
            f"| {r['demote_lag']['p99_ms']} / {r['promote_stream_lag']['p99_ms']} |"
        )
    lines.append(f"\nIdle loop lag p99: {results['idle_lag']['p99_ms']} ms (the ticker alone).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="lmserver-bench-hfhome-"))
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    parser = argparse.ArgumentParser(prog="python -m bench.hfbucket", description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,32", help="object sizes in MiB, comma-separated")
    parser.add_argument("--total", type=int, default=256, help="MiB moved per size and direction")
    parser.add_argument("--concurrency", type=int, default=32, help="tier operations in flight")
    parser.add_argument("--out", help="write results.json and table.md here")
    args = parser.parse_args(argv)
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    results = asyncio.run(run(sizes, args.total * MiB, args.concurrency))
    table = format_table(results)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(results, indent=2))
        (out / "table.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
