"""NIXL tier throughput: PUT (demotion) and GET (promotion) against the raw limit, same run.

POSIX: NixlTier (dynamic layout) vs os.pwrite / os.preadv of the same bytes to files in
the same directory. OBJ: NixlTier vs boto3 put_object / get_object against a local S3
server (moto, started here). GET reads are warm (page cache) on both sides.

    python -m bench.nixl_tier [--dir DIR] [--count N] [--sizes 1,4,32] [--obj/--no-obj]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable

from lmproto import ObjectMeta
from lmserver.storage.tiers.nixl import NixlTier
from lmserver.storage.tiers.spec import TierSpec

MiB = 1 << 20
META = ObjectMeta(0, 0, (0, 0, 0, 0), 0)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def timed(fn: Callable[[int], Awaitable[object]], count: int) -> float:
    started = time.perf_counter()
    for i in range(count):
        await fn(i)
    return time.perf_counter() - started


async def run_tier(spec: str, size: int, count: int) -> tuple[float, float]:
    tier = NixlTier.from_spec(TierSpec.parse(spec))
    await tier.open()
    data = memoryview(os.urandom(size))
    sink = bytearray(size)
    try:
        put = await timed(lambda i: tier.put(f"k{size}-{i}", data, META), count)
        get = await timed(lambda i: tier.get_into(f"k{size}-{i}", lambda n: memoryview(sink)[:n]), count)
        assert tier.usage().counters["hits"] == count
    finally:
        await tier.close()
    return gbps(size * count, put), gbps(size * count, get)


def run_raw_files(directory: str, size: int, count: int) -> tuple[float, float]:
    data = os.urandom(size)
    sink = bytearray(size)
    paths = [os.path.join(directory, f"raw-{size}-{i}") for i in range(count)]
    started = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.pwrite(fd, data, 0)
        os.close(fd)
    put = time.perf_counter() - started
    started = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.preadv(fd, [sink], 0)
        os.close(fd)
    get = time.perf_counter() - started
    for p in paths:
        os.unlink(p)
    return gbps(size * count, put), gbps(size * count, get)


def run_raw_s3(s3: object, bucket: str, size: int, count: int) -> tuple[float, float]:
    data = os.urandom(size)
    started = time.perf_counter()
    for i in range(count):
        s3.put_object(Bucket=bucket, Key=f"raw/{size}/{i}", Body=data)  # type: ignore[attr-defined]
    put = time.perf_counter() - started
    started = time.perf_counter()
    for i in range(count):
        s3.get_object(Bucket=bucket, Key=f"raw/{size}/{i}")["Body"].read()  # type: ignore[attr-defined]
    get = time.perf_counter() - started
    return gbps(size * count, put), gbps(size * count, get)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory for the POSIX runs (default: a temp dir)")
    ap.add_argument("--count", type=int, default=8, help="objects per size")
    ap.add_argument("--sizes", default="1,4,32", help="object sizes in MiB")
    ap.add_argument("--obj", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    sizes = [int(s) * MiB for s in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for size in sizes:
            cap = f"{size * args.count * 2}"
            tier = asyncio.run(run_tier(f"nixl:{d}/tier?capacity={cap}", size, args.count))
            raw = run_raw_files(d, size, args.count)
            rows.append(("POSIX", size, tier, raw))
    if args.obj:
        from tests.tiers.nixl_support import S3Server

        s3 = S3Server()
        try:
            for size in sizes:
                bucket = s3.bucket()
                spec = (
                    f"nixl:s3://{bucket}/kv?endpoint={s3.endpoint}&access_key=test&secret_key=test"
                    f"&timeout=120&capacity={size * args.count * 2}"
                )
                tier = asyncio.run(run_tier(spec, size, args.count))
                raw = run_raw_s3(s3.s3, bucket, size, args.count)
                rows.append(("OBJ", size, tier, raw))
        finally:
            s3.stop()
    print(
        "| backend | size | tier PUT GB/s | raw PUT GB/s | PUT ratio"
        " | tier GET GB/s | raw GET GB/s | GET ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for backend, size, (tp, tg), (rp, rg) in rows:
        print(
            f"| {backend} | {size // MiB} MiB | {tp:.2f} | {rp:.2f} | {tp / rp:.2f}"
            f" | {tg:.2f} | {rg:.2f} | {tg / rg:.2f} |"
        )


if __name__ == "__main__":
    main()
