"""DiskTier against real files and a real SQLite index in tmp_path.

The one fake: ``test_enospc_*`` replaces ``_diskfile.write_object`` to raise ENOSPC on a
filesystem with room (nothing to evict helps); ``test_full_filesystem_*`` fills a real 16 MiB
tmpfs (needs root to mount it; skipped otherwise), and ``test_real_write_error_*`` gets a
real kernel error (EFBIG from RLIMIT_FSIZE) in a subprocess.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import mmap
import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from lmproto import ObjectMeta
from lmserver.tiers import _diskfile
from lmserver.tiers.base import ConfigError, NoSpace, Victim
from lmserver.tiers.disk import DIRECT_MIN, DiskTier, FsyncPolicy
from lmserver.tiers.spec import TierSpec

META = ObjectMeta(fmt=1, dtype=3, shape=(2, 16, 256, 128), location=1)
REPO = Path(__file__).resolve().parents[2]


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


def files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]


def object_files(root: Path) -> list[Path]:
    return files_under(root / "objects")


def disk_bytes(root: Path) -> int:
    total = 0
    for sub in ("objects", "tmp"):
        for p in files_under(root / sub):
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
    return total


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def remove_index(root: Path) -> None:
    for p in root.glob("index.sqlite3*"):
        p.unlink()


def file_of(root: Path, key: str) -> Path:
    name = _diskfile.object_name(key.encode())
    return root / "objects" / _diskfile.object_relpath(name)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
async def tier(root: Path) -> AsyncIterator[DiskTier]:
    t = DiskTier(root, capacity=256 << 20)
    await t.open()
    yield t
    await t.close()


async def reopen(root: Path, **kw: object) -> DiskTier:
    kw.setdefault("capacity", 256 << 20)
    t = DiskTier(root, **kw)  # type: ignore[arg-type]
    await t.open()
    return t


# -- basics -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fsync", ["always", "batch", "never"])
async def test_round_trip_with_meta(root: Path, fsync: FsyncPolicy) -> None:
    t = DiskTier(root, capacity=64 << 20, fsync=fsync)
    await t.open()
    try:
        data = payload(1, 1 << 20)
        assert await t.put("k1", memoryview(data), META)
        assert t.contains("k1") and not t.contains("k2")
        assert await get(t, "k1") == (data, META)
        assert await get(t, "k2") is None
        assert await t.put("empty", memoryview(b""), ObjectMeta())
        assert await get(t, "empty") == (b"", ObjectMeta())
        u = t.usage()
        assert u.objects == 2
        assert u.bytes == sum(p.stat().st_size for p in object_files(root))
        assert u.counters["hits"] == 2 and u.counters["misses"] == 1
        assert u.counters["inflight_bytes"] == 0
    finally:
        await t.close()


async def test_overwrite_and_delete(tier: DiskTier, root: Path) -> None:
    assert await tier.put("k", memoryview(b"a" * 1000), META)
    assert await tier.put("k", memoryview(b"b" * 10), ObjectMeta(fmt=4))
    assert await get(tier, "k") == (b"b" * 10, ObjectMeta(fmt=4))
    assert len(object_files(root)) == 1
    assert tier.usage().objects == 1
    assert tier.usage().bytes == file_of(root, "k").stat().st_size
    assert await tier.delete("k")
    assert not await tier.delete("k")
    assert not tier.contains("k") and await get(tier, "k") is None
    assert object_files(root) == [] and tier.usage().bytes == 0
    assert tier.keys() == []


async def test_keys_sorted_with_prefix(tier: DiskTier) -> None:
    for k in ["b/2", "a/1", "b/1", "c", "b"]:
        assert await tier.put(k, memoryview(b"x"), META)
    assert tier.keys() == ["a/1", "b", "b/1", "b/2", "c"]
    assert tier.keys("b/") == ["b/1", "b/2"]
    assert tier.keys("zz") == []


async def test_alloc_nospace_propagates_and_object_stays(tier: DiskTier) -> None:
    assert await tier.put("k", memoryview(b"abc"), META)

    def alloc(n: int) -> memoryview:
        raise NoSpace("full")

    with pytest.raises(NoSpace):
        await tier.get_into("k", alloc)
    assert await get(tier, "k") == (b"abc", META)


async def test_second_open_of_same_directory_refused(tier: DiskTier, root: Path) -> None:
    other = DiskTier(root, capacity=1 << 20)
    with pytest.raises(RuntimeError, match="in use"):
        await other.open()


# -- persistence --------------------------------------------------------------------------------


async def test_restart_10000_objects_keeps_data_and_lru(root: Path) -> None:
    n, size = 10_000, 100
    t = await reopen(root)
    keys = [f"model@1@0@{i:06x}@bfloat16" for i in range(n)]
    for i, k in enumerate(keys):  # one after another: the put order is the LRU order
        assert await t.put(k, memoryview(payload(i, size)), META)
    for k in keys[:100]:  # make the first 100 the most recently used
        assert await get(t, k) is not None
    total = t.usage().bytes
    await t.close()

    t = await reopen(root, capacity=total)  # exactly full
    try:
        assert t.usage().objects == n and t.usage().bytes == total
        assert sorted(keys) == t.keys()
        newcomer = f"model@1@0@{n:06x}@bfloat16"  # same length: evicts exactly one object
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
    db = sqlite3.connect(root / "index.sqlite3")
    before = db.execute("SELECT key, recency FROM objects ORDER BY key").fetchall()
    assert len(before) == 5
    assert await get(t, "k0") is not None  # k0 becomes the most recent
    await t.sync_index()
    assert db.execute("SELECT key, recency FROM objects ORDER BY key").fetchall() == before  # batched
    await t.close()
    after = dict(db.execute("SELECT key, recency FROM objects").fetchall())
    db.close()
    assert after["k0"] == max(after.values())
    one = file_of(root, "k0").stat().st_size
    t = await reopen(root, capacity=5 * one)
    try:
        assert await t.put("k5", memoryview(b"y" * 100), META)
        assert not t.contains("k1") and t.contains("k0")
    finally:
        await t.close()


async def test_capacity_lowered_at_reopen_evicts_lru(root: Path) -> None:
    t = await reopen(root)
    for i in range(10):
        assert await t.put(f"k{i}", memoryview(b"x" * 1000), META)
    one = file_of(root, "k0").stat().st_size
    await t.close()
    t = await reopen(root, capacity=4 * one)
    try:
        assert t.keys() == ["k6", "k7", "k8", "k9"]
        assert len(object_files(root)) == 4
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


async def test_index_deleted_is_rebuilt_from_files(root: Path) -> None:
    objs = await _fill(root)
    remove_index(root)
    used = sum(p.stat().st_size for p in object_files(root))
    t = await reopen(root, capacity=used)
    try:
        # Rebuilt in write order: the first written is the least recently used.
        assert await t.put("more-0", memoryview(b"m" * 999), META)  # the size of key-0's file
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


async def test_row_whose_file_is_gone_is_dropped_lazily(root: Path) -> None:
    objs = await _fill(root, 5)
    file_of(root, "key-2").unlink()
    t = await reopen(root)  # clean shutdown: no listing at open
    try:
        assert await get(t, "key-2") is None
        assert not t.contains("key-2")
        assert t.usage().counters["missing"] == 1
        del objs["key-2"]
        await _assert_all_served(t, objs)
    finally:
        await t.close()


async def test_unclean_shutdown_reconciles_rows_and_files(root: Path) -> None:
    objs = await _fill(root, 5)
    file_of(root, "key-1").unlink()
    # An object file written but never indexed (a crash after the rename):
    t = await reopen(root)
    assert await t.put("late", memoryview(b"late" * 10), META)
    await t.close()
    db = sqlite3.connect(root / "index.sqlite3")
    with db:
        db.execute("DELETE FROM objects WHERE key = 'late'")
        db.execute("UPDATE meta SET v = '0' WHERE k = 'clean'")
    db.close()
    t = await reopen(root)
    try:
        assert not t.contains("key-1") and t.contains("late")
        assert await get(t, "late") == (b"late" * 10, META)
        del objs["key-1"]
        objs["late"] = b"late" * 10
        assert t.usage().objects == len(objs)
    finally:
        await t.close()


def write_version_behind_the_index(root: Path, key: str, body: bytes, meta: ObjectMeta = META) -> None:
    """What a crash between a rename and its index write leaves: a newer whole file."""
    header = _diskfile.encode_header(key.encode(), len(body), _diskfile.checksum(body), meta, time.time_ns())
    file_of(root, key).write_bytes(header + body)


@pytest.mark.parametrize("same_size", [True, False])
async def test_file_newer_than_its_row_is_reindexed_not_deleted(root: Path, same_size: bool) -> None:
    await _fill(root, 3)
    newer = payload(99, 1001 if same_size else 5000)
    newer_meta = ObjectMeta(fmt=2, dtype=5, shape=(1, 2, 3, 4), location=2)
    write_version_behind_the_index(root, "key-1", newer, newer_meta)
    db = sqlite3.connect(root / "index.sqlite3")
    with db:
        db.execute("UPDATE meta SET v = '0' WHERE k = 'clean'")  # the crash
    db.close()
    t = await reopen(root)
    try:
        # The listing at open cannot tell a same-size stale row: the first GET still serves
        # the newer (whole, checked) file, with its own metadata, and repairs the row.
        assert await get(t, "key-1") == (newer, newer_meta)
        assert t.usage().counters["index_repairs"] == int(same_size)
        assert await get(t, "key-1") == (newer, newer_meta)
        assert t.usage().counters["corrupt"] == 0
        assert t.usage().bytes == sum(p.stat().st_size for p in object_files(root))
    finally:
        await t.close()


async def test_check_files_drops_rows_at_open(root: Path) -> None:
    await _fill(root, 5)
    file_of(root, "key-3").unlink()
    t = await reopen(root, check_files=True)
    try:
        assert not t.contains("key-3") and t.usage().objects == 4
    finally:
        await t.close()


async def test_temp_files_removed_at_open(root: Path) -> None:
    await _fill(root, 3)
    for i in range(5):
        (root / "tmp" / f"leftover{i}").write_bytes(b"partial" * 100)
    t = await reopen(root)
    try:
        assert list((root / "tmp").iterdir()) == []
        assert t.usage().objects == 3
    finally:
        await t.close()


# -- integrity ----------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["body", "key", "meta"])
async def test_flipped_byte_is_a_miss_never_wrong_data(tier: DiskTier, root: Path, where: str) -> None:
    data = payload(7, 4096)
    assert await tier.put("victim", memoryview(data), META)
    path = file_of(root, "victim")
    raw = bytearray(path.read_bytes())
    offset = {"body": len(raw) - 100, "key": _diskfile.FIXED_SIZE + 1, "meta": 30}[where]
    raw[offset] ^= 0x01
    path.write_bytes(raw)
    assert await get(tier, "victim") is None
    assert tier.usage().counters["corrupt"] == 1
    assert not tier.contains("victim") and not path.exists()


async def test_truncated_file_is_a_miss(tier: DiskTier, root: Path) -> None:
    assert await tier.put("t", memoryview(payload(3, 10_000)), META)
    path = file_of(root, "t")
    truncate(path, 5000)
    assert await get(tier, "t") is None
    assert tier.usage().counters["corrupt"] == 1 and not tier.contains("t")


async def test_corrupt_files_skipped_by_rebuild(root: Path) -> None:
    objs = await _fill(root, 5)
    path = file_of(root, "key-4")
    truncate(path, 50)
    (root / "objects" / "abc").mkdir(exist_ok=True)
    (root / "objects" / "abc" / "not-an-object").write_bytes(b"junk")
    remove_index(root)
    t = await reopen(root)
    try:
        del objs["key-4"]
        await _assert_all_served(t, objs)
        assert not path.exists()
    finally:
        await t.close()


# -- capacity -----------------------------------------------------------------------------------


async def test_disk_usage_never_exceeds_capacity(root: Path) -> None:
    """While 3x the capacity is written by concurrent puts: the tier's accounting, which
    counts every file present (indexed, being written, evicted but not yet unlinked), stays
    within capacity at every sample, and equals the real file sizes whenever puts are idle.
    (A directory walk racing the writers is no snapshot: it can count an evicted file and
    its replacement both, so the real sizes are compared only between bursts.)"""
    capacity = 1 << 20
    t = DiskTier(root, capacity=capacity, max_workers=8)
    await t.open()
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            u = t.usage()
            peak = max(peak, u.bytes + u.counters["inflight_bytes"])

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        written = 0
        rng = random.Random(0)
        i = 0
        while written < 3 * capacity:
            sizes = [rng.randint(1, 200_000) for _ in range(8)]
            puts = (t.put(f"k{i + j}", memoryview(bytes(s)), META) for j, s in enumerate(sizes))
            oks = await asyncio.gather(*puts)
            i += len(sizes)
            written += sum(s for s, ok in zip(sizes, oks, strict=True) if ok)
            u = t.usage()
            assert u.counters["inflight_bytes"] == 0
            assert u.bytes == disk_bytes(root) <= capacity
        assert t.usage().counters["evictions"] > 0
    finally:
        stop.set()
        sampler.join()
        await t.close()
    assert 0 < peak <= capacity


@pytest.mark.parametrize("concurrent", [1, 8])
async def test_held_victims_count_without_emptying_the_tier(root: Path, concurrent: int) -> None:
    """Files held for demotion count against capacity: puts evict enough to cover them once,
    not every object (which a total that stays over capacity would ask for), and concurrent
    puts do not each cover the same excess."""
    t = DiskTier(root, capacity=100 * 10_100)
    held: list[Victim] = []
    t.on_evict = held.append  # a tier behind that has not finished demoting them
    await t.open()
    try:
        fewest = 100
        for i in range(0, 400, concurrent):
            batch = [f"k{j}" for j in range(i, i + concurrent)]
            assert all(await asyncio.gather(*(t.put(k, memoryview(bytes(10_000)), META) for k in batch)))
            if i >= 120:
                fewest = min(fewest, t.usage().objects)
        u = t.usage()
        held_objects = u.counters["held_bytes"] // 10_000
        assert u.counters["held_bytes"] <= t.capacity // 8
        assert fewest >= 100 - held_objects - concurrent - 2, fewest  # never emptied
        assert u.bytes + u.counters["held_bytes"] <= t.capacity
    finally:
        for victim in held:
            victim.release()
        await t.close()


async def test_object_larger_than_capacity_declined(root: Path) -> None:
    t = DiskTier(root, capacity=10_000)
    await t.open()
    try:
        assert await t.put("small", memoryview(b"s" * 100), META)
        assert not await t.put("huge", memoryview(b"h" * 10_000), META)
        assert t.usage().counters["declined_too_large"] == 1
        assert t.contains("small") and not t.contains("huge")
    finally:
        await t.close()


# -- hostile keys -------------------------------------------------------------------------------

HOSTILE_KEYS = [
    "a/b/c",
    "../../../../etc/passwd",
    "..",
    "/abs/path",
    "ctl\x01\x02\t\n\r\x1b\x7f",
    "€" * 50,  # 150 bytes of 3-byte UTF-8
    "é" * 75,  # 150 bytes of 2-byte UTF-8
    " spaces ",
    "model@8@3@deadbeef@bfloat16@tag%v",
]


def assert_everything_inside(top: Path, root: Path) -> None:
    assert [p.name for p in top.iterdir()] == ["data"]
    assert [p.name for p in (top / "data").iterdir()] == ["disk"]
    real_root = root.resolve()
    for p in files_under(top):
        assert p.resolve().is_relative_to(real_root), p
        assert p.name.isascii() and len(p.name) <= 64


async def test_hostile_keys_stay_inside_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "data" / "disk"
    t = await reopen(root)
    try:
        for i, key in enumerate(HOSTILE_KEYS):
            assert await t.put(key, memoryview(payload(i, 300)), META), key
        for i, key in enumerate(HOSTILE_KEYS):
            assert await get(t, key) == (payload(i, 300), META), key
        assert t.keys() == sorted(HOSTILE_KEYS)
    finally:
        await t.close()
    assert_everything_inside(tmp_path, root)
    remove_index(root)  # and they survive a rebuild from the file headers
    t = await reopen(root)
    try:
        assert t.keys() == sorted(HOSTILE_KEYS)
        for i, key in enumerate(HOSTILE_KEYS):
            assert await get(t, key) == (payload(i, 300), META), key
    finally:
        await t.close()


async def test_invalid_keys_and_meta_declined(tier: DiskTier) -> None:
    assert not await tier.put("\udcff", memoryview(b"x"), META)  # not encodable as UTF-8
    assert not await tier.put("k", memoryview(b"x"), ObjectMeta(fmt=2**40))
    assert tier.usage().counters["declined_invalid"] == 2
    assert tier.usage().counters["inflight_bytes"] == 0 and tier.keys() == []


# -- direct I/O --------------------------------------------------------------------------------


def mapped(data: bytes) -> memoryview:
    """``data`` in an anonymous mmap: page-aligned and writable, like a memory-tier object."""
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return memoryview(buf)


async def test_large_objects_are_written_directly_and_read_back(root: Path) -> None:
    t = await reopen(root)
    try:
        if not t.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        big, odd, small = payload(1, 1 << 20), payload(2, DIRECT_MIN + 5), payload(3, 5000)
        for key, data in (("big", big), ("odd", odd), ("small", small)):
            assert await t.put(key, mapped(data), META)
        headers = {k: _diskfile.read_header_at(str(file_of(root, k)))[0] for k in ("big", "odd", "small")}
        assert headers["big"].header_len == headers["odd"].header_len == _diskfile.ALIGN  # padded: direct
        assert headers["small"].header_len == _diskfile.header_size(b"small")  # below DIRECT_MIN
        assert await t.put("bytes", memoryview(big), META)  # read-only: buffered, unpadded
        assert _diskfile.read_header_at(str(file_of(root, "bytes")))[0].header_len < _diskfile.ALIGN
        assert t.usage().bytes == sum(p.stat().st_size for p in object_files(root))
        for key, data in (("big", big), ("odd", odd), ("small", small), ("bytes", big)):
            assert await get(t, key) == (data, META)
    finally:
        await t.close()
    # Version-2 files survive a restart, through the index and through a rebuild from files.
    t = await reopen(root)
    try:
        assert await get(t, "odd") == (odd, META)
    finally:
        await t.close()
    (root / "index.sqlite3").unlink()
    t = await reopen(root)
    try:
        assert sorted(t.keys()) == ["big", "bytes", "odd", "small"]
        assert await get(t, "big") == (big, META)
    finally:
        await t.close()


async def test_direct_off_writes_through_the_page_cache(root: Path) -> None:
    t = await reopen(root, direct="off")
    try:
        assert not t.direct_io
        assert await t.put("big", mapped(payload(1, 1 << 20)), META)
        assert _diskfile.read_header_at(str(file_of(root, "big")))[0].header_len < _diskfile.ALIGN
    finally:
        await t.close()


async def test_a_refused_direct_write_falls_back_to_buffered(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that passed the probe but refuses a write (EINVAL): the object is still
    stored, and the tier stops trying direct I/O."""
    t = await reopen(root)
    try:
        if not t.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        real_write = _diskfile.write_object
        calls: list[bool] = []

        def refuse_direct(fd: int, header: bytes, body: memoryview, *, direct: bool = False) -> None:
            calls.append(direct)
            if direct:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            real_write(fd, header, body)

        monkeypatch.setattr(_diskfile, "write_object", refuse_direct)
        data = payload(1, 1 << 20)
        with capture_logs() as logs:
            assert await t.put("k", mapped(data), META)
        assert await t.put("k2", mapped(data), META)
        assert calls == [True, False, False] and not t.direct_io
        assert await get(t, "k") == (data, META)
        assert t.usage().counters["write_errors"] == 0 and list((root / "tmp").iterdir()) == []
        assert any("direct I/O refused" in e["event"] for e in logs)
    finally:
        await t.close()


async def test_direct_option_in_the_tier_spec(root: Path) -> None:
    assert DiskTier.from_spec(TierSpec.parse(f"disk:{root}?direct=off")).direct == "off"
    assert DiskTier.from_spec(TierSpec.parse(f"disk:{root}")).direct == "auto"
    with pytest.raises(ConfigError):
        DiskTier.from_spec(TierSpec.parse(f"disk:{root}?direct=sometimes"))


# -- errors -------------------------------------------------------------------------------------


async def test_enospc_on_write_is_declined_and_tier_keeps_serving(
    tier: DiskTier, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The one fake in this file: no size-limited filesystem can be mounted here.
    real_write = _diskfile.write_object

    def full_disk(fd: int, header: bytes, body: memoryview, *, direct: bool = False) -> None:
        os.write(fd, header)  # a partial file is left behind, as a real ENOSPC would
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert await tier.put("before", memoryview(b"ok"), META)
    monkeypatch.setattr(_diskfile, "write_object", full_disk)
    assert not await tier.put("k", memoryview(b"x" * 5000), META)
    assert not await tier.put("before", memoryview(b"replacement"), META)
    monkeypatch.setattr(_diskfile, "write_object", real_write)
    u = tier.usage()
    assert u.counters["write_errors"] == 2 and u.counters["inflight_bytes"] == 0
    assert list((root / "tmp").iterdir()) == []
    assert not tier.contains("k")
    assert await get(tier, "before") == (b"ok", META)  # the old version is intact
    assert await tier.put("after", memoryview(b"fine"), META)
    assert await get(tier, "after") == (b"fine", META)


@pytest.mark.parametrize(("fsync", "taker"), [("never", False), ("batch", True)])
async def test_full_filesystem_evicts_lru_and_retries(
    small_fs: Path, fsync: FsyncPolicy, taker: bool
) -> None:
    """A real 16 MiB filesystem under a 64 MiB capacity: concurrent puts that run into ENOSPC
    lower the effective capacity, evict older objects, retry and succeed (also while a
    tier behind holds evicted files for demotion: they take space too)."""
    root = small_fs / "disk"
    t = DiskTier(root, capacity=64 << 20, fsync=fsync)
    held: list[Victim] = []
    if taker:
        t.on_evict = held.append  # demotions that never finish during the test
    await t.open()
    try:
        objs = {f"k{i}": payload(i, 200_000) for i in range(150)}  # 30 MB
        keys = list(objs)
        for start in range(0, len(keys), 8):
            batch = keys[start : start + 8]
            oks = await asyncio.gather(*(t.put(k, memoryview(objs[k]), META) for k in batch))
            assert all(oks), (start, t.usage())
        u = t.usage()
        assert u.capacity == 64 << 20 and 0 < u.counters["effective_capacity"] < 16 << 20
        assert u.bytes <= u.counters["effective_capacity"] and u.counters["evictions"] > 0
        assert u.counters["out_of_space"] > 0 and u.counters["write_errors"] == 0
        assert u.bytes == sum(p.stat().st_size for p in object_files(root))
        assert list((root / "tmp").iterdir()) == []
        for k in keys[-8:]:
            assert await get(t, k) == (objs[k], META)
        assert u.counters["held_bytes"] == sum(p.stat().st_size for p in files_under(root / "evicted"))
    finally:
        for victim in held:
            victim.release()
        await t.close()


def fill_up(path: Path) -> None:
    """Write ``path`` until its filesystem is full."""
    with open(path, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(bytes(64 << 10))


async def test_open_on_a_full_filesystem_fails_plainly_and_keeps_the_index(small_fs: Path) -> None:
    root = small_fs / "disk"
    objs = await _fill(root, 20)
    ballast = small_fs / "ballast"
    fill_up(ballast)
    with pytest.raises(OSError) as failed:
        await reopen(root)
    assert failed.value.errno == errno.ENOSPC and "full" in str(failed.value)
    assert not (root / "index.sqlite3.corrupt").exists()  # a full disk is not a corrupt index
    ballast.unlink()
    t = await reopen(root)
    try:
        await _assert_all_served(t, objs)
    finally:
        await t.close()


_EFBIG_SCRIPT = """
import asyncio, resource, signal, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from pathlib import Path
from lmproto import ObjectMeta
from lmserver.tiers.disk import DiskTier

async def main(root):
    t = DiskTier(root, capacity=64 << 20)
    await t.open()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    big = await t.put("big", memoryview(bytes(2 << 20)), ObjectMeta())
    small = await t.put("small", memoryview(b"s" * 100), ObjectMeta())
    u = t.usage()
    tmp = list((Path(root) / "tmp").iterdir())
    await t.close()
    print(big, small, u.counters["write_errors"], u.counters["inflight_bytes"], len(tmp), t.contains("big"))

asyncio.run(main(sys.argv[1]))
"""


def test_real_write_error_efbig_is_declined(root: Path) -> None:
    """A real kernel write error (EFBIG past RLIMIT_FSIZE), in a subprocess."""
    out = subprocess.run(
        [sys.executable, "-c", _EFBIG_SCRIPT, str(root)],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        cwd=REPO,
    )
    assert out.stdout.split() == ["False", "True", "1", "0", "0", "False"], out.stderr


async def test_batch_lone_put_does_not_wait_for_the_window(root: Path) -> None:
    t = DiskTier(root, capacity=64 << 20, fsync="batch", batch_window_s=30.0)
    await t.open()
    try:
        started = time.monotonic()
        assert await t.put("alone", memoryview(b"x" * 1000), META)
        assert time.monotonic() - started < 5.0  # no other writer: the batch closed at once
        oks = await asyncio.gather(*(t.put(f"k{i}", memoryview(payload(i, 50_000)), META) for i in range(40)))
        assert all(oks) and t.usage().objects == 41
    finally:
        await t.close()


async def test_closed_tier_declines_politely(root: Path) -> None:
    t = await reopen(root)
    assert await t.put("k", memoryview(b"v"), META)
    await t.close()
    await t.close()  # idempotent
    assert not await t.put("k2", memoryview(b"v"), META)
    assert await t.get_into("k", Allocator()) is None
    assert not await t.delete("k")


# -- concurrency --------------------------------------------------------------------------------


@pytest.mark.parametrize("fsync", ["never", "batch"])
async def test_concurrent_puts_of_one_key_leave_one_whole_object(root: Path, fsync: FsyncPolicy) -> None:
    t = DiskTier(root, capacity=64 << 20, fsync=fsync, max_workers=8)
    await t.open()
    versions = [payload(i, 10_000 + 997 * i) for i in range(32)]
    try:
        oks = await asyncio.gather(*(t.put("same", memoryview(v), META) for v in versions))
        assert all(oks)
        got = await get(t, "same")
        assert got is not None and got[0] in versions
        assert len(object_files(root)) == 1
        u = t.usage()
        assert u.objects == 1 and u.bytes == file_of(root, "same").stat().st_size
        assert u.counters["inflight_bytes"] == 0
    finally:
        await t.close()
    t = await reopen(root)
    try:
        assert await get(t, "same") == got
    finally:
        await t.close()


async def test_mixed_concurrent_puts_gets_deletes(root: Path) -> None:
    t = DiskTier(root, capacity=300_000, max_workers=8)
    await t.open()
    rng = random.Random(1)
    expected: dict[str, set[bytes]] = {}

    async def worker(w: int) -> None:
        for step in range(150):
            key = f"k{rng.randrange(20)}"
            op = rng.random()
            if op < 0.5:
                data = payload(w * 1000 + step, rng.randrange(1, 30_000))
                expected.setdefault(key, set()).add(data)
                await t.put(key, memoryview(data), META)
            elif op < 0.9:
                got = await get(t, key)
                if got is not None:
                    assert got[0] in expected[key]
            else:
                await t.delete(key)

    try:
        await asyncio.gather(*(worker(w) for w in range(8)))
        u = t.usage()
        assert u.counters["corrupt"] == 0 and u.counters["inflight_bytes"] == 0
        assert u.bytes == sum(p.stat().st_size for p in object_files(root)) <= t.capacity
        assert len(object_files(root)) == u.objects
    finally:
        await t.close()


async def test_event_loop_not_blocked_by_a_64mib_put(root: Path) -> None:
    # Behaviour, not timing: if the write ran on the loop, the probe could not run at all
    # until it returned; running in a worker, the loop keeps turning while it is in flight.
    t = DiskTier(root, capacity=256 << 20, fsync="always")
    await t.open()
    data = bytes(64 << 20)
    turns_while_writing = 0
    put = asyncio.ensure_future(t.put("big", memoryview(data), META))

    async def probe() -> None:
        nonlocal turns_while_writing
        while not put.done():
            turns_while_writing += 1
            await asyncio.sleep(0)

    task = asyncio.create_task(probe())
    try:
        assert await put
        got = await get(t, "big")
        assert got is not None and got[0] == data
    finally:
        await task
        await t.close()
    assert turns_while_writing > 1


async def test_cancelled_get_waits_for_its_reader(tier: DiskTier) -> None:
    assert await tier.put("k", memoryview(payload(1, 8 << 20)), META)
    alloc = Allocator()
    task = asyncio.create_task(tier.get_into("k", alloc))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    # The worker finished before the cancellation surfaced: the buffer is no longer written.
    snapshot = bytes(alloc.buffers[-1])
    await asyncio.sleep(0.05)
    assert bytes(alloc.buffers[-1]) == snapshot


# -- crash safety -------------------------------------------------------------------------------


def _crash_body(key: str, version: int) -> bytes:
    head = f"{key}:{version}:".encode()
    return head + random.Random(head).randbytes(1000 + (version * 7919) % 200_000)


_CRASH_WRITER = """
import asyncio, sys, random
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from lmproto import ObjectMeta
from lmserver.tiers.disk import DiskTier

def body(key, version):
    head = f"{key}:{version}:".encode()
    return head + random.Random(head).randbytes(1000 + (version * 7919) % 200_000)

async def main(root, fsync):
    # 4 MiB: puts still evict now and then, but never every object (in flight at most
    # 8 x 201 kB, plus victims not yet unlinked), so some object survives any kill.
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
        assert list((root / "tmp").iterdir()) == []
        present = 0
        for i in range(8):
            got = await get(t, f"k{i}")
            if got is not None:
                present += 1
                assert _intact(f"k{i}", got[0])
        assert present > 0, (t.usage(), len(object_files(root)))
        u = t.usage()
        assert u.counters["corrupt"] == 0
        assert len(object_files(root)) == u.objects
    finally:
        await t.close()
