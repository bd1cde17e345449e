"""DiskTier's space and writes: the capacity is never exceeded (counting what the segments
really hold), evicted records' blocks come back in runs, write errors and a full
filesystem are declined or worked around, concurrent use stays consistent.

The fakes here: ``test_enospc_*`` and ``test_a_refused_direct_write_*`` replace the writer's
one write function (no filesystem refuses on demand); ``test_*_without_hole_punching`` makes
the probe say no. Everything else is a real filesystem (a real 16 MiB tmpfs for a full one)."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disktier import META, Allocator, allocated, get, mapped, on_disk, payload, reopen, segment_files
from structlog.testing import capture_logs

from lmserver.storage.tiers.base import Victim
from lmserver.storage.tiers.disk import DiskTier, FsyncPolicy
from lmserver.storage.tiers.disk import tier as disk_tier_module
from lmserver.storage.tiers.disk import writer as disk_writer

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
async def tier(root: Path) -> AsyncIterator[DiskTier]:
    t = DiskTier(root, capacity=256 << 20)
    await t.open()
    yield t
    await t.close()


# -- capacity -----------------------------------------------------------------------------------


async def test_disk_usage_never_exceeds_capacity(root: Path) -> None:
    """While 3x the capacity is written by concurrent puts: the tier's accounting (records
    indexed, being written, evicted but not given back yet) stays within the capacity at
    every sample, and equals what the segments really hold whenever the tier is settled."""
    capacity = 1 << 20
    t = DiskTier(root, capacity=capacity, max_workers=8)
    await t.open()
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            u = t.usage()
            peak = max(peak, u.bytes + u.counters["inflight_bytes"] + u.counters["held_bytes"])

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
            assert allocated(root) <= capacity  # what the disk holds, even before settling
            await t.settle()
            u = t.usage()
            assert u.counters["inflight_bytes"] == 0
            assert u.bytes == allocated(root) <= capacity
        assert t.usage().counters["evictions"] > 0
    finally:
        stop.set()
        sampler.join()
        await t.close()
    assert 0 < peak <= capacity


async def test_evicted_records_are_given_back_in_runs(root: Path) -> None:
    """Eviction runs ahead of need and the reclaimer punches neighbours as one range: far
    fewer punches than evicted records (each one costs the filesystem real time)."""
    t = DiskTier(root, capacity=4 << 20, evict_ahead=1 << 20)
    await t.open()
    try:
        for start in range(0, 400, 8):
            assert all(
                await asyncio.gather(
                    *(t.put(f"k{i}", memoryview(bytes(30_000)), META) for i in range(start, start + 8))
                )
            )
        await t.settle()
        evicted = t.usage().counters["evictions"]
        assert t._reclaimer is not None
        assert evicted > 200 and t._reclaimer.punch_calls * 4 < evicted
        assert t._space is not None and t._space.ahead > 0
        assert t.usage().bytes == allocated(root) <= (4 << 20) - t._space.ahead + 8 * 32768
    finally:
        await t.close()


async def test_a_segment_with_nothing_left_is_removed(root: Path) -> None:
    t = await reopen(root)
    for i in range(5):
        assert await t.put(f"old{i}", memoryview(b"o" * 100), META)
    await t.close()
    t = await reopen(root)  # writes go to a new segment now
    try:
        assert len(segment_files(root)) == 1
        assert await t.put("new", memoryview(b"n" * 100), META)
        assert len(segment_files(root)) == 2
        for i in range(5):
            assert await t.delete(f"old{i}")
        await t.settle()
        assert len(segment_files(root)) == 1 and list(on_disk(root)) == ["new"]
    finally:
        await t.close()


@pytest.mark.parametrize("concurrent", [1, 8])
async def test_held_victims_count_without_emptying_the_tier(root: Path, concurrent: int) -> None:
    """Records held for demotion count against capacity: puts evict enough to cover them
    once, not every object, and concurrent puts do not each cover the same excess."""
    t = DiskTier(root, capacity=100 * 12_288, evict_ahead=0)
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
        held_objects = u.counters["held_bytes"] // 12_288
        assert u.counters["held_bytes"] <= t.capacity // 8
        assert fewest >= 100 - held_objects - concurrent - 2, fewest  # never emptied
        assert u.bytes + u.counters["held_bytes"] <= t.capacity
        await t.settle()
        assert allocated(root) == u.bytes + u.counters["held_bytes"]  # held ones stay on disk
        victim = held[0]
        data = victim.open()  # a held record reads back whole, verified
        assert bytes(data) == bytes(10_000)
        data.release()
    finally:
        for victim in held:
            victim.release()
        await t.close()


async def test_space_comes_back_without_hole_punching(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A filesystem that cannot punch holes: evicted records' blocks come back with their
    whole segment, counted until then, so the capacity still holds; writing goes on."""
    monkeypatch.setattr(disk_tier_module, "punch_works", lambda directory: False)
    monkeypatch.setattr("lmserver.storage.tiers.disk.writer.SEGMENT_BYTES", 256 << 10)
    capacity = 2 << 20
    t = DiskTier(root, capacity=capacity)
    with capture_logs() as logs:
        await t.open()
    try:
        assert not t.punching and any("punch" in e["event"] for e in logs)
        for start in range(0, 600, 8):
            oks = await asyncio.gather(
                *(t.put(f"k{i}", memoryview(bytes(20_000)), META) for i in range(start, start + 8))
            )
            assert all(oks), t.usage()
            sizes = sum(p.stat().st_blocks * 512 for p in segment_files(root))
            assert sizes <= capacity + 8 * (256 << 10)  # nothing given back is counted as free
            assert t.usage().bytes + t.usage().counters["inflight_bytes"] <= capacity
        assert t.usage().counters["evictions"] > 0 and len(segment_files(root)) < 20
        for i in range(592, 600):
            assert await get(t, f"k{i}") == (bytes(20_000), META)
    finally:
        await t.close()


# -- write errors -------------------------------------------------------------------------------


async def test_enospc_on_write_is_declined_and_tier_keeps_serving(
    tier: DiskTier, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = disk_writer.write_all

    def full_disk(fd: int, parts: list[disk_writer._Part], offset: int) -> None:
        os.pwrite(fd, bytes(4096), offset)  # a partial write is left behind, as a real one would
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    assert await tier.put("before", memoryview(b"ok"), META)
    monkeypatch.setattr(disk_writer, "write_all", full_disk)
    assert not await tier.put("k", memoryview(b"x" * 5000), META)
    assert not await tier.put("before", memoryview(b"replacement"), META)
    monkeypatch.setattr(disk_writer, "write_all", real_write)
    await tier.settle()
    u = tier.usage()
    assert u.counters["out_of_space"] >= 2 and u.counters["inflight_bytes"] == 0
    assert not tier.contains("k")
    assert await get(tier, "before") == (b"ok", META)  # the old version is intact
    assert u.bytes == allocated(root)  # the partial writes were given back
    assert await tier.put("after", memoryview(b"fine"), META)
    assert await get(tier, "after") == (b"fine", META)


async def test_a_refused_direct_write_falls_back_to_buffered(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem that passed the probe but refuses a direct write (EINVAL): the object is
    still stored, and the tier stops trying direct I/O."""
    t = await reopen(root)
    try:
        if not t.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        real_write = disk_writer.write_all
        calls: list[bool] = []

        def refuse_direct(fd: int, parts: list[disk_writer._Part], offset: int) -> None:
            direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
            calls.append(direct)
            if direct:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
            real_write(fd, parts, offset)

        monkeypatch.setattr(disk_writer, "write_all", refuse_direct)
        data = payload(1, 1 << 20)
        with capture_logs() as logs:
            assert await t.put("k", mapped(data), META)
        assert await t.put("k2", mapped(data), META)
        assert calls == [True, False, False]
        assert await get(t, "k") == (data, META)
        assert t.usage().counters["write_errors"] == 0
        assert any("direct I/O refused" in e["event"] for e in logs)
    finally:
        await t.close()


@pytest.mark.parametrize(("fsync", "taker"), [("never", False), ("batch", True)])
async def test_full_filesystem_evicts_lru_and_retries(
    small_fs: Path, fsync: FsyncPolicy, taker: bool
) -> None:
    """A real 16 MiB filesystem under a 64 MiB capacity: concurrent puts that run into ENOSPC
    lower the effective capacity, evict older objects, retry and succeed (also while a tier
    behind holds evicted records for demotion: they take space too)."""
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
        for k in keys[-8:]:
            assert await get(t, k) == (objs[k], META)
    finally:
        for victim in held:
            victim.release()
        await t.close()


def fill_up(path: Path) -> None:
    """Write ``path`` until its filesystem is full."""
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(bytes(64 << 10))
        except OSError:
            pass


async def test_open_on_a_full_filesystem_fails_plainly_and_keeps_the_index(small_fs: Path) -> None:
    root = small_fs / "disk"
    t = await reopen(root)
    objs = {f"key-{i}": payload(i, 1000 + i) for i in range(20)}
    for k, v in objs.items():
        assert await t.put(k, memoryview(v), META)
    await t.close()
    ballast = small_fs / "ballast"
    fill_up(ballast)
    with pytest.raises(OSError) as failed:
        await reopen(root)
    assert failed.value.errno == errno.ENOSPC and "full" in str(failed.value)
    assert not (root / "index.sqlite3.corrupt").exists()  # a full disk is not a corrupt index
    ballast.unlink()
    t = await reopen(root)
    try:
        for k, v in objs.items():
            assert await get(t, k) == (v, META)
    finally:
        await t.close()


_EFBIG_SCRIPT = """
import asyncio, resource, signal, sys
import structlog
structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
from lmproto import ObjectMeta
from lmserver.storage.tiers.disk import DiskTier

async def main(root):
    t = DiskTier(root, capacity=64 << 20)
    await t.open()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
    big = await t.put("big", memoryview(bytes(2 << 20)), ObjectMeta())
    small = await t.put("small", memoryview(b"s" * 100), ObjectMeta())
    await t.settle()
    u = t.usage()
    await t.close()
    print(big, small, u.counters["write_errors"], u.counters["inflight_bytes"], t.contains("big"))

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
    assert out.stdout.split() == ["False", "True", "1", "0", "False"], out.stderr


async def test_batch_lone_put_does_not_wait_for_the_window(root: Path) -> None:
    t = DiskTier(root, capacity=64 << 20, fsync="batch", batch_window_s=30.0)
    await t.open()
    try:
        started = time.monotonic()
        assert await t.put("alone", memoryview(b"x" * 1000), META)
        assert time.monotonic() - started < 5.0  # no other write in flight: synced at once
        oks = await asyncio.gather(*(t.put(f"k{i}", memoryview(payload(i, 50_000)), META) for i in range(40)))
        assert all(oks) and t.usage().objects == 41
    finally:
        await t.close()


async def test_the_segment_directory_removed_under_the_server(root: Path) -> None:
    """``rm -rf`` of the segments while serving: what they held is lost (counted), and
    writing goes on in a new segment (it never fails for good on a missing directory)."""
    t = await reopen(root)
    try:
        assert await t.put("gone", memoryview(b"g" * 100), META)
        shutil.rmtree(root / "segments")
        await asyncio.sleep(disk_tier_module._DIRECTORY_CHECK_S + 0.1)
        assert await t.put("trigger", memoryview(b"t" * 100), META)  # a put notices, off the loop
        await t.settle()
        for _ in range(100):
            if not t.contains("gone"):
                break
            await asyncio.sleep(0.05)
        assert not t.contains("gone") and t.usage().counters["missing"] >= 1
        assert await t.put("after", memoryview(b"a" * 100), META)
        assert await get(t, "after") == (b"a" * 100, META)
        assert (root / "segments").is_dir() and "after" in on_disk(root)
    finally:
        await t.close()
    t = await reopen(root)  # and the restart serves what was written after
    try:
        assert await get(t, "after") == (b"a" * 100, META)
    finally:
        await t.close()


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
        await t.settle()
        assert list(on_disk(root)) == ["same"] and len(on_disk(root)["same"]) == 1
        u = t.usage()
        assert u.objects == 1 and u.bytes == allocated(root)
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
        await t.settle()
        u = t.usage()
        assert u.counters["corrupt"] == 0 and u.counters["inflight_bytes"] == 0
        assert u.bytes == allocated(root) <= t.capacity
        assert sorted(on_disk(root)) == t.keys()
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
