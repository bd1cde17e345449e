"""Helpers for the disk tier's tests: fill, read back and look inside a tier's directory
(segments, the SQLite index) the way an operator or a crash would."""

from __future__ import annotations

import mmap
import os
import random
import sqlite3
from pathlib import Path

from lmproto import ObjectMeta
from lmserver.storage.tiers.disk import DiskTier
from lmserver.storage.tiers.disk.records import Record
from lmserver.storage.tiers.disk.recovery import scan
from lmserver.storage.tiers.disk.segments import SegmentSet, data_ranges

META = ObjectMeta(fmt=1, dtype=3, shape=(2, 16, 256, 128), location=1)


class Allocator:
    """An ``Alloc`` handing out fresh bytearrays filled with garbage (0xEE)."""

    def __init__(self) -> None:
        self.buffers: list[bytearray] = []

    def __call__(self, n: int) -> memoryview:
        buf = bytearray(b"\xee" * n)
        self.buffers.append(buf)
        return memoryview(buf)


async def get(tier: DiskTier, key: str) -> tuple[bytes, ObjectMeta] | None:
    alloc = Allocator()
    meta = await tier.get_into(key, alloc)
    if meta is None:
        return None
    return bytes(alloc.buffers[-1]), meta


def payload(i: int, n: int) -> bytes:
    return random.Random(i).randbytes(n)


def mapped(data: bytes) -> memoryview:
    """``data`` in an anonymous mmap: page-aligned and writable, like a memory-tier object."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


async def reopen(root: Path, **kw: object) -> DiskTier:
    kw.setdefault("capacity", 256 << 20)
    t = DiskTier(root, **kw)  # type: ignore[arg-type]
    await t.open()
    return t


def segment_files(root: Path) -> list[Path]:
    return sorted((root / "segments").glob("*.log"))


def allocated(root: Path) -> int:
    """Bytes of data the segments really hold (their holes excluded; the filesystem's own
    extent maps are not ours to count, as its directories were not for one file per object)."""
    total = 0
    for path in segment_files(root):
        fd = os.open(path, os.O_RDONLY)
        try:
            total += sum(end - start for start, end in data_ranges(fd, 0, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return total


def on_disk(root: Path) -> dict[str, list[int]]:
    """key -> offsets of every whole-headed record in the segments, in log order."""
    segments = SegmentSet(str(root / "segments"))
    found: dict[str, list[int]] = {}
    try:
        for segment in segments.open_existing():
            for offset, header in scan(segment):
                found.setdefault(header.key, []).append(offset)
    finally:
        segments.close()
    return found


def record_on_disk(root: Path, key: str) -> tuple[Path, int, int]:
    """The segment file, offset and header length of ``key``'s (last) record on disk."""
    segments = SegmentSet(str(root / "segments"))
    found = None
    try:
        for segment in segments.open_existing():
            for offset, header in scan(segment):
                if header.key == key:
                    found = (Path(segment.path), offset, header.header_len)
    finally:
        segments.close()
    assert found is not None, key
    return found


def record_of(tier: DiskTier, key: str) -> tuple[Path, Record]:
    """Where ``key``'s record lies (its segment file and index record)."""
    rec = tier._index.get(key)
    assert rec is not None, key
    return Path(tier._segments.path_of(rec.segment)), rec


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def remove_index(root: Path) -> None:
    for p in root.glob("index.sqlite3*"):
        p.unlink()


def mark_unclean(root: Path) -> None:
    """What a crash leaves in the index: the clean flag unset."""
    db_execute(root, "UPDATE meta SET v = '0' WHERE k = 'clean'")


def db_execute(root: Path, sql: str, params: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    db = sqlite3.connect(root / "index.sqlite3")
    try:
        with db:
            return db.execute(sql, params).fetchall()
    finally:
        db.close()


def count_files(top: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(top) for f in fs]
