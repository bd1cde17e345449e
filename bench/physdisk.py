"""Raw file throughput on the disk the disk tier uses: the physical limit for disk variants.

Strategy: one file per object (what a disk tier does), written from a preallocated buffer
and fsynced each, then dropped from the page cache with ``posix_fadvise(DONTNEED)`` (clean
pages are dropped, so the read is cold-ish without root or a global cache drop) and read
back with ``readinto`` a preallocated buffer. Bounded by a byte budget and a time cap.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any


def disk_limit(directory: Path, size: int, budget: int, time_cap: float = 5.0) -> dict[str, Any]:
    work = directory / f"rawdisk-{os.getpid()}-{size}"
    work.mkdir(parents=True, exist_ok=True)
    buf = bytearray(os.urandom(size))
    mv = memoryview(buf)
    count = max(2, budget // size)
    paths: list[Path] = []
    t0 = time.perf_counter()
    try:
        for i in range(count):
            p = work / f"obj{i}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                pos = 0
                while pos < size:
                    pos += os.write(fd, mv[pos:])
                os.fsync(fd)
            finally:
                os.close(fd)
            paths.append(p)
            if time.perf_counter() - t0 > time_cap:
                break
        write_s = time.perf_counter() - t0
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        t1 = time.perf_counter()
        for p in paths:
            with p.open("rb", buffering=0) as fh:
                pos = 0
                while pos < size:
                    n = fh.readinto(mv[pos:])
                    if not n:
                        break
                    pos += n
        read_s = time.perf_counter() - t1
    finally:
        for p in work.iterdir():
            with contextlib.suppress(OSError):
                p.unlink()
        with contextlib.suppress(OSError):
            work.rmdir()
    moved = len(paths) * size
    return {
        "size": size,
        "objects": len(paths),
        "bytes": moved,
        "write_fsync_gbps": moved / write_s / 1e9 if write_s > 0 else None,
        "read_cold_gbps": moved / read_s / 1e9 if read_s > 0 else None,
        "write_s": write_s,
        "read_s": read_s,
    }
