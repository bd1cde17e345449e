"""DiskTier across restarts and crashes: the index loaded in LRU order, rebuilt from the
segments when it is lost, reconciled after an unclean stop; corruption is a miss, never
wrong data; a SIGKILL in the middle of writes leaves only whole objects."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from disktier import (
    META,
    allocated,
    db_execute,
    flip_byte,
    get,
    mark_unclean,
    on_disk,
    payload,
    record_of,
    remove_index,
    reopen,
    segment_files,
)

from lmproto import ObjectMeta
from lmserver.storage.tiers import _diskfile
from lmserver.storage.tiers.disk import DiskTier
from lmserver.storage.tiers.disk import index as dbindex

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


async def test_restart_10000_objects_keeps_data_and_lru(root: Path) -> None:
    n, size = 10_000, 100
    t = await reopen(root, evict_ahead=0)
    keys = [f"model@1@0@{i:06x}@bfloat16" for i in range(n)]
    for i, k in enumerate(keys):  # one after another: the put order is the LRU order
        assert await t.put(k, memoryview(payload(i, size)), META)
    for k in keys[:100]:  # make the first 100 the most recently used
        assert await get(t, k) is not None
    total = t.usage().bytes
    await t.close()

    t = await reopen(root, capacity=total, evict_ahead=0)  # exactly full
    try:
        assert t.usage().objects == n and t.usage().bytes == total
        assert sorted(keys) == t.keys()
        newcomer = f"model@1@0@{n:06x}@bfloat16"  # same size: evicts exactly one object
        assert await t.put(newcomer, memoryview(payload(n, size)), META)
        assert t.usage().counters["evictions"] == 1
        assert not t.contains(keys[100])  # the least recently used went
        assert t.contains(keys[0]) and t.contains(keys[99]) and t.contains(keys[101])
        for i, k in enumerate(keys):
            if i != 100:
                assert await get(t, k) == (payload(i, size), META), k
    finally:
        await t.close()


async def test_recency_survives_restart_without_a_write_per_get(root: Path) -> None:
    t = await reopen(root, recency_flush_s=3600)
    for i in range(5):
        assert await t.put(f"k{i}", memoryview(b"x" * 100), META)
    await t.sync_index()
    before = db_execute(root, "SELECT key, recency FROM objects ORDER BY key")
    assert len(before) == 5
    assert await get(t, "k0") is not None  # k0 becomes the most recent
    await t.sync_index()
    assert db_execute(root, "SELECT key, recency FROM objects ORDER BY key") == before  # batched
    await t.close()
    after = dict(db_execute(root, "SELECT key, recency FROM objects"))
    assert after["k0"] == max(after.values())  # type: ignore[type-var]
    t = await reopen(root, capacity=5 * 4096, evict_ahead=0)
    try:
        assert await t.put("k5", memoryview(b"y" * 100), META)
        assert not t.contains("k1") and t.contains("k0")
    finally:
        await t.close()


async def test_capacity_lowered_at_reopen_evicts_lru(root: Path) -> None:
    t = await reopen(root)
    for i in range(10):
        assert await t.put(f"k{i}", memoryview(b"x" * 1000), META)
    await t.close()
    t = await reopen(root, capacity=4 * 4096, evict_ahead=0)
    try:
        assert t.keys() == ["k6", "k7", "k8", "k9"]
        await t.settle()
        assert allocated(root) == 4 * 4096
    finally:
        await t.close()


async def _fill(root: Path, n: int = 50) -> dict[str, bytes]:
    t = await reopen(root)
    objs = {f"key-{i}": payload(i, 1000 + i) for i in range(n)}
    for k, v in objs.items():
        assert await t.put(k, memoryview(v), META)
    await t.close()
    return objs


async def _assert_all_served(t: DiskTier, objs: dict[str, bytes]) -> None:
    assert t.usage().objects == len(objs)
    for k, v in objs.items():
        assert await get(t, k) == (v, META)


async def test_index_deleted_is_rebuilt_from_the_segments(root: Path) -> None:
    objs = await _fill(root)
    remove_index(root)
    t = await reopen(root, capacity=allocated(root), evict_ahead=0)
    try:
        # Rebuilt in write order: the first written is the least recently used.
        assert await t.put("more-0", memoryview(b"m" * 999), META)  # one block, as key-0
        assert not t.contains("key-0") and t.contains("key-1")
        del objs["key-0"]
        objs["more-0"] = b"m" * 999
        await _assert_all_served(t, objs)
    finally:
        await t.close()


async def test_index_with_garbage_is_rebuilt(root: Path) -> None:
    objs = await _fill(root)
    db = root / "index.sqlite3"
    db.write_bytes(os.urandom(db.stat().st_size or 8192))
    t = await reopen(root)
    try:
        await _assert_all_served(t, objs)
        assert (root / "index.sqlite3.corrupt").exists()
    finally:
        await t.close()
    t = await reopen(root)  # and the rebuilt index is a good one
    try:
        await _assert_all_served(t, objs)
    finally:
        await t.close()


async def test_index_of_the_old_file_per_object_layout_is_rebuilt(root: Path) -> None:
    """An index of another schema (the file-per-object layout's) is not trusted."""
    objs = await _fill(root, 5)
    db_execute(root, "UPDATE meta SET v = '1' WHERE k = 'schema'")
    t = await reopen(root)
    try:
        await _assert_all_served(t, objs)
    finally:
        await t.close()


async def test_a_punched_record_whose_row_stayed_is_dropped_lazily(root: Path) -> None:
    """A crash after an eviction gave a record's blocks back but before its row went."""
    objs = await _fill(root, 5)
    t = await reopen(root)
    path, rec = record_of(t, "key-2")
    await t.close()
    from lmserver.storage.tiers.disk.segments import punch_hole

    fd = os.open(path, os.O_RDWR)
    try:
        punch_hole(fd, rec.offset, rec.size)
    finally:
        os.close(fd)
    t = await reopen(root)  # clean shutdown: nothing is read at open
    try:
        assert await get(t, "key-2") is None
        assert not t.contains("key-2")
        assert t.usage().counters["missing"] == 1 and t.usage().counters["corrupt"] == 0
        del objs["key-2"]
        await _assert_all_served(t, objs)
    finally:
        await t.close()


async def test_unclean_stop_finds_records_the_index_missed(root: Path) -> None:
    """Records written (and acknowledged) whose rows never reached SQLite are read back in
    from above the segment's watermark; a newer version replaces an older row."""
    await _fill(root, 5)
    t = await reopen(root)
    _path, old = record_of(t, "key-1")
    newer, newer_meta = payload(99, 5000), ObjectMeta(fmt=2, dtype=5, shape=(1, 2, 3, 4), location=2)
    assert await t.put("key-1", memoryview(newer), newer_meta)
    assert await t.put("late", memoryview(b"late" * 10), META)
    _path, late = record_of(t, "late")
    await t.close()
    # The crash: the rows of the last two writes never committed, the watermark stayed.
    db_execute(root, "DELETE FROM objects WHERE key = 'late'")
    db_execute(root, "INSERT OR REPLACE INTO objects VALUES (?, ?, ?, ?)", dbindex.row("key-1", old, 1))
    db_execute(root, "UPDATE segments SET safe = ?", (min(late.offset, record_of_offset_of_newer(root)),))
    mark_unclean(root)
    t = await reopen(root)
    try:
        assert await get(t, "late") == (b"late" * 10, META)
        assert await get(t, "key-1") == (newer, newer_meta)
        assert t.usage().objects == 6 and t.usage().counters["corrupt"] == 0
        await t.settle()
        assert t.usage().bytes == allocated(root)  # space nothing covers was given back
    finally:
        await t.close()


def record_of_offset_of_newer(root: Path) -> int:
    return max(on_disk(root)["key-1"])


async def test_unclean_stop_drops_rows_of_a_lost_segment(root: Path) -> None:
    t = await reopen(root)
    for i in range(3):
        assert await t.put(f"a{i}", memoryview(b"a" * 100), META)
    await t.close()
    t = await reopen(root)  # a new segment per open
    for i in range(3):
        assert await t.put(f"b{i}", memoryview(b"b" * 100), META)
    await t.close()
    first = segment_files(root)[0]
    first.unlink()
    mark_unclean(root)
    t = await reopen(root)
    try:
        assert t.keys() == ["b0", "b1", "b2"] and t.usage().counters["missing"] == 3
    finally:
        await t.close()


async def test_check_files_reconciles_even_after_a_clean_stop(root: Path) -> None:
    await _fill(root, 5)
    segment_files(root)[0].unlink()
    t = await reopen(root, check_files=True)
    try:
        assert t.usage().objects == 0
    finally:
        await t.close()


# -- integrity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["body", "key", "meta"])
async def test_flipped_byte_is_a_miss_never_wrong_data(root: Path, where: str) -> None:
    t = await reopen(root)
    try:
        data = payload(7, 4096)
        assert await t.put("victim", memoryview(data), META)
        assert await t.put("bystander", memoryview(data), META)
        path, rec = record_of(t, "victim")
        offset = {"body": rec.header_len + 100, "key": _diskfile.FIXED_SIZE + 1, "meta": 30}[where]
        flip_byte(path, rec.offset + offset)
        assert await get(t, "victim") is None
        assert t.usage().counters["corrupt"] == 1
        assert not t.contains("victim")
        assert await get(t, "bystander") == (data, META)
        await t.settle()
        assert list(on_disk(root)) == ["bystander"]  # the bad record is punched out
    finally:
        await t.close()


async def test_truncated_segment_is_a_miss(root: Path) -> None:
    t = await reopen(root)
    try:
        assert await t.put("t", memoryview(payload(3, 10_000)), META)
        path, rec = record_of(t, "t")
        os.truncate(path, rec.offset + 5000)
        assert await get(t, "t") is None
        assert t.usage().counters["corrupt"] == 1 and not t.contains("t")
    finally:
        await t.close()


async def test_damaged_records_are_skipped_by_a_rebuild(root: Path) -> None:
    objs = await _fill(root, 5)
    t = await reopen(root)
    path, rec = record_of(t, "key-4")
    await t.close()
    os.truncate(path, rec.offset + 50)  # the last record torn in its header
    (root / "segments" / "not-a-segment.log").write_bytes(b"junk")
    (root / "segments" / "0000000000000077.log").write_bytes(os.urandom(10_000))
    remove_index(root)
    t = await reopen(root)
    try:
        del objs["key-4"]
        await _assert_all_served(t, objs)
    finally:
        await t.close()


# -- crash safety -------------------------------------------------------------------------------


def _crash_body(key: str, version: int) -> bytes:
    head = f"{key}:{version}:".encode()
    return head + __import__("random").Random(head).randbytes(1000 + (version * 7919) % 200_000)


_CRASH_WRITER = """
import asyncio, sys, random
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from lmproto import ObjectMeta
from lmserver.storage.tiers.disk import DiskTier
from lmserver.storage.tiers.disk import index as dbindex

def body(key, version):
    head = f"{key}:{version}:".encode()
    return head + random.Random(head).randbytes(1000 + (version * 7919) % 200_000)

async def main(root, fsync):
    t = DiskTier(root, capacity=4 << 20, fsync=fsync)
    await t.open()
    print("ready", flush=True)
    version = 0
    while True:
        version += 1
        await asyncio.gather(*(t.put(f"k{i}", memoryview(body(f"k{i}", version + i)), ObjectMeta())
                               for i in range(8)))
        if version <= 3:
            print("acked", version, flush=True)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def _intact(key: str, data: bytes) -> bool:
    parts = data.split(b":", 2)
    return len(parts) == 3 and parts[0] == key.encode() and data == _crash_body(key, int(parts[1]))


@pytest.mark.parametrize(
    ("fsync", "delay"), [("always", 0.05), ("always", 0.4), ("batch", 0.2), ("never", 0.2)]
)
async def test_sigkill_during_writes_leaves_only_whole_objects(root: Path, fsync: str, delay: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASH_WRITER, str(root), fsync, cwd=REPO, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        assert (await proc.stdout.readline()).strip() == b"ready"
        for n in (1, 2, 3):  # acknowledged puts exist before the kill, however slow the disk
            line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
            assert line.split() == [b"acked", str(n).encode()]
        await asyncio.sleep(delay)  # then kill somewhere in the middle of later rounds
    finally:
        proc.send_signal(signal.SIGKILL)
        await proc.wait()
    assert proc.returncode == -signal.SIGKILL
    t = await reopen(root)
    try:
        present = 0
        for i in range(8):
            got = await get(t, f"k{i}")
            if got is not None:
                present += 1
                assert _intact(f"k{i}", got[0])
        assert present == 8, t.usage()  # every key was acknowledged at least once
        u = t.usage()
        assert u.counters["corrupt"] == 0
        await t.settle()
        assert u.bytes == allocated(root) <= 4 << 20  # a torn tail is given back
    finally:
        await t.close()
