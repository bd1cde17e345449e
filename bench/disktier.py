"""``python -m bench.disktier``: the disk tier against the device it runs on, in one run.

Strategy: the same directory, the same bytes, measured four ways one after another, so
every ratio compares like with like on a host whose speed moves between runs:

* **device write**: one sequential file written in 4 MiB pieces and fsynced (what the
  device takes at its best through the page cache);
* **file per object**: a create, a write, a close and a rename per object (the layout the
  disk tier had before its log; no fsync, as ``--fsync never``);
Each size runs ``--rounds`` rounds of all five; a ratio is the median of the rounds' own
ratios, with their range.

* **tier drain**: objects of the given size in page-aligned memory (as memory-tier slots
  are) handed to a ``DiskTier`` with ``--in-flight`` puts outstanding (as the chain's
  write-behind queue does), timed until the last put completes;
* **device read** / **tier read**: the sequential file, and the tier's objects in write
  order (``--in-flight`` GETs outstanding at all times), each after its pages were dropped from the page
  cache (``posix_fadvise``), so both come from the device.

Run against another checkout's tier with ``PYTHONPATH=/path/to/checkout`` (the tier API is
the same): that is how the before/after figures in ``bench/PERFORMANCE.md`` were taken.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from lmproto import ObjectMeta
from lmserver.storage.tiers.disk import DiskTier

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20, "32MiB": 32 << 20}
_PIECE = 4 << 20


def _filled(size: int) -> mmap.mmap:
    buf = mmap.mmap(-1, size)
    seed = os.urandom(1 << 16)
    for start in range(0, size, len(seed)):
        buf[start : start + len(seed)] = seed[: size - start]
    return buf


def _drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def device_write(directory: Path, total: int) -> tuple[float, Path]:
    """Seconds to write ``total`` bytes sequentially in 4 MiB pieces, fsync included."""
    path = directory / "device.seq"
    piece = _filled(_PIECE)
    started = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for offset in range(0, total, _PIECE):
            os.pwrite(fd, memoryview(piece)[: min(_PIECE, total - offset)], offset)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - started, path


def device_read(path: Path) -> float:
    _drop_cache(path)
    buf = bytearray(_PIECE)
    started = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - started


def file_per_object(directory: Path, size: int, count: int) -> float:
    """Seconds for ``count`` objects written one file each (create, write, close, rename)."""
    folder = directory / "files"
    folder.mkdir()
    body = _filled(size)
    started = time.perf_counter()
    for i in range(count):
        tmp = folder / f"tmp{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, body)
        finally:
            os.close(fd)
        os.rename(tmp, folder / f"obj{i}")
    elapsed = time.perf_counter() - started
    shutil.rmtree(folder)
    return elapsed


async def tier_drain_and_read(
    directory: Path, size: int, count: int, in_flight: int, fsync: str
) -> tuple[float, float, dict[str, Any]]:
    """Seconds to store ``count`` objects, then to read them all back from the device."""
    root = directory / "tier"
    bodies = [_filled(size) for _ in range(min(in_flight, count))]
    meta = ObjectMeta()
    tier = DiskTier(root, capacity=2 * count * (size + 8192) + (64 << 20), fsync=fsync)  # type: ignore[arg-type]
    await tier.open()
    try:
        slots = asyncio.Semaphore(in_flight)

        async def put(i: int) -> None:
            async with slots:
                body = memoryview(bodies[i % len(bodies)])[:size]
                if not await tier.put(f"obj{i:07d}", body, meta):
                    raise RuntimeError(f"the tier declined obj{i}: {tier.usage()}")

        started = time.perf_counter()
        await asyncio.gather(*(put(i) for i in range(count)))
        drain = time.perf_counter() - started
        settle = getattr(tier, "settle", None)
        if settle is not None:
            await settle()
        for path in root.rglob("*"):
            if path.is_file() and not path.name.startswith("index"):
                _drop_cache(path)
        targets = [_filled(size) for _ in range(in_flight)]  # touched, as memory-tier slots are

        busy: list[mmap.mmap] = []

        async def get(i: int) -> None:
            async with slots:
                buf = targets.pop()  # one of in_flight buffers, none shared by two reads
                busy.append(buf)
                target = memoryview(buf)
                try:
                    if await tier.get_into(f"obj{i:07d}", lambda n: target[:n]) is None:
                        raise RuntimeError(f"obj{i} missed")
                finally:
                    target.release()
                    busy.remove(buf)
                    targets.append(buf)

        started = time.perf_counter()
        await asyncio.gather(*(get(i) for i in range(count)))  # asked in write order
        read = time.perf_counter() - started
        usage = tier.usage().counters
    finally:
        await tier.close()
        shutil.rmtree(root, ignore_errors=True)
    return drain, read, usage


def measure(directory: Path, size: int, count: int, in_flight: int, fsync: str) -> dict[str, float]:
    """One round: MB/s of each of the five measurements, one after another."""
    moved = count * size
    work = Path(tempfile.mkdtemp(prefix="disktier-", dir=directory))
    try:
        write_s, seq = device_write(work, moved)
        read_s = device_read(seq)
        seq.unlink()
        files_s = file_per_object(work, size, count)
        drain_s, tier_read_s, _usage = asyncio.run(tier_drain_and_read(work, size, count, in_flight, fsync))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "device_write": moved / write_s / 1e6,
        "file_per_object": moved / files_s / 1e6,
        "tier_drain": moved / drain_s / 1e6,
        "device_read": moved / read_s / 1e6,
        "tier_read": moved / tier_read_s / 1e6,
    }


RATIOS = {
    "drain_x_device": ("tier_drain", "device_write"),
    "drain_x_file_per_object": ("tier_drain", "file_per_object"),
    "read_x_device": ("tier_read", "device_read"),
}


def run(
    directory: Path, sizes: list[str], total: int, in_flight: int, fsync: str, rounds: int
) -> list[dict[str, Any]]:
    rows = []
    for name in sizes:
        size = SIZES[name]
        count = max(4, total // size)
        measured = [measure(directory, size, count, in_flight, fsync) for _ in range(rounds)]
        row: dict[str, Any] = {"size": name, "objects": count, "bytes": count * size, "rounds": rounds}
        row["mb_per_s"] = {k: round(statistics.median(m[k] for m in measured)) for k in measured[0]}
        for ratio, (num, den) in RATIOS.items():
            per_round = sorted(m[num] / m[den] for m in measured)
            row[ratio] = {
                "median": round(statistics.median(per_round), 2),
                "min": round(per_round[0], 2),
                "max": round(per_round[-1], 2),
            }
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row: dict[str, Any]) -> str:
    m = row["mb_per_s"]

    def ratio(name: str) -> str:
        r = row[name]
        return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"

    return (
        f"{row['size']:>6}  drain {m['tier_drain']:>5} MB/s = {ratio('drain_x_device')} device write "
        f"({m['device_write']} MB/s), {ratio('drain_x_file_per_object')} file-per-object "
        f"({m['file_per_object']} MB/s);  read {m['tier_read']:>5} MB/s = {ratio('read_x_device')} "
        f"device read ({m['device_read']} MB/s)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.disktier", description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="a directory on the disk")
    ap.add_argument("--sizes", default=",".join(SIZES), help=f"object sizes, of {', '.join(SIZES)}")
    ap.add_argument("--total", type=int, default=1 << 30, help="bytes per size (default 1 GiB)")
    ap.add_argument("--in-flight", type=int, default=16, help="puts (and gets) outstanding")
    ap.add_argument("--fsync", default="never", choices=("never", "batch", "always"))
    ap.add_argument("--rounds", type=int, default=3, help="rounds per size (median ratio, range)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        ap.error(f"unknown size(s) {unknown}; choose from {list(SIZES)}")
    print(
        f"# disk tier vs device: {args.dir}, {args.total >> 20} MiB per size, {args.in_flight} in flight,"
        f" {args.rounds} rounds (median ratio of the rounds, range)"
    )
    rows = run(args.dir, sizes, args.total, args.in_flight, args.fsync, args.rounds)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
