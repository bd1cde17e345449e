"""DiskTier: round trips, overwrite and delete, keys, hostile keys, direct I/O, bad input.
Real files on the test machine's filesystem, real SQLite."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disktier import (
    META,
    Allocator,
    allocated,
    count_files,
    get,
    mapped,
    on_disk,
    payload,
    record_of,
    remove_index,
    reopen,
    segment_files,
)

from lmproto import ObjectMeta
from lmserver.storage.tiers import _diskfile
from lmserver.storage.tiers.base import ConfigError, NoSpace
from lmserver.storage.tiers.disk import DIRECT_MIN, DiskTier, FsyncPolicy
from lmserver.storage.tiers.spec import TierSpec


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
async def tier(root: Path) -> AsyncIterator[DiskTier]:
    t = DiskTier(root, capacity=256 << 20, evict_ahead=0)
    await t.open()
    yield t
    await t.close()


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
        await t.settle()
        u = t.usage()
        assert u.objects == 2
        assert u.bytes == allocated(root)  # what the index counts is what the disk holds
        assert u.counters["hits"] == 2 and u.counters["misses"] == 1
        assert u.counters["inflight_bytes"] == 0
    finally:
        await t.close()


async def test_overwrite_and_delete(tier: DiskTier, root: Path) -> None:
    assert await tier.put("k", memoryview(b"a" * 1000), META)
    assert await tier.put("k", memoryview(b"b" * 10), ObjectMeta(fmt=4))
    assert await get(tier, "k") == (b"b" * 10, ObjectMeta(fmt=4))
    await tier.settle()
    assert list(on_disk(root)) == ["k"] and len(on_disk(root)["k"]) == 1  # the old one punched out
    assert tier.usage().objects == 1 and tier.usage().bytes == allocated(root) == 4096
    assert await tier.delete("k")
    assert not await tier.delete("k")
    assert not tier.contains("k") and await get(tier, "k") is None
    await tier.settle()
    assert on_disk(root) == {} and tier.usage().bytes == 0 == allocated(root)
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


async def test_small_objects_share_segments_and_large_ones_follow(root: Path) -> None:
    """The log layout itself: records packed at block boundaries in few files, small ones
    written together (fewer device writes than objects), every one self-describing."""
    t = await reopen(root)
    try:
        small = {f"s{i}": payload(i, 60_000 + i) for i in range(40)}
        assert all(await asyncio.gather(*(t.put(k, memoryview(v), META) for k, v in small.items())))
        assert await t.put("big", mapped(payload(99, 3 << 20)), META)
        await t.settle()
        assert len(segment_files(root)) == 1
        offsets = on_disk(root)
        assert sorted(offsets) == sorted([*small, "big"])
        assert all(o % _diskfile.ALIGN == 0 for v in offsets.values() for o in v)
        _path, big = record_of(t, "big")
        assert big.offset > max(record_of(t, k)[1].offset for k in small)  # appended after them
        for k, v in small.items():
            assert await get(t, k) == (v, META)
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


async def test_invalid_keys_and_meta_declined(tier: DiskTier) -> None:
    assert not await tier.put("\udcff", memoryview(b"x"), META)  # not encodable as UTF-8
    assert not await tier.put("k", memoryview(b"x"), ObjectMeta(fmt=2**40))
    assert tier.usage().counters["declined_invalid"] == 2
    assert tier.usage().counters["inflight_bytes"] == 0 and tier.keys() == []


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
    real_root = root.resolve()
    for p in count_files(tmp_path):  # names never come from keys
        assert p.resolve().is_relative_to(real_root), p
        assert p.name.isascii() and len(p.name) <= 64
    remove_index(root)  # and they survive a rebuild from the record headers
    t = await reopen(root)
    try:
        assert t.keys() == sorted(HOSTILE_KEYS)
        for i, key in enumerate(HOSTILE_KEYS):
            assert await get(t, key) == (payload(i, 300), META), key
    finally:
        await t.close()


# -- direct I/O --------------------------------------------------------------------------------


async def test_large_objects_are_written_directly_and_read_back(root: Path) -> None:
    t = await reopen(root)
    try:
        if not t.direct_io:
            pytest.skip("this filesystem refuses O_DIRECT")
        big, odd, small = payload(1, 1 << 20), payload(2, DIRECT_MIN + 5), payload(3, 5000)
        for key, data in (("big", big), ("odd", odd), ("small", small)):
            assert await t.put(key, mapped(data), META)
        headers = {k: record_of(t, k)[1].header_len for k in ("big", "odd", "small")}
        assert headers["big"] == headers["odd"] == _diskfile.ALIGN  # padded: straight from memory
        assert headers["small"] == _diskfile.header_size(b"small")  # packed into a combined write
        assert await t.put("bytes", memoryview(big), META)  # read-only memory: packed, unpadded
        assert record_of(t, "bytes")[1].header_len < _diskfile.ALIGN
        await t.settle()
        assert t.usage().bytes == allocated(root)
        for key, data in (("big", big), ("odd", odd), ("small", small), ("bytes", big)):
            assert await get(t, key) == (data, META)
    finally:
        await t.close()
    t = await reopen(root)  # through the index
    try:
        assert await get(t, "odd") == (odd, META)
    finally:
        await t.close()
    remove_index(root)
    t = await reopen(root)  # and through a rebuild from the segments
    try:
        assert sorted(t.keys()) == ["big", "bytes", "odd", "small"]
        assert await get(t, "big") == (big, META)
    finally:
        await t.close()


async def test_direct_off_writes_through_the_page_cache(root: Path) -> None:
    t = await reopen(root, direct="off")
    try:
        assert not t.direct_io
        data = payload(1, 1 << 20)
        assert await t.put("big", mapped(data), META)
        assert record_of(t, "big")[1].header_len < _diskfile.ALIGN
        assert await get(t, "big") == (data, META)
    finally:
        await t.close()


async def test_direct_option_in_the_tier_spec(root: Path) -> None:
    assert DiskTier.from_spec(TierSpec.parse(f"disk:{root}?direct=off")).direct == "off"
    assert DiskTier.from_spec(TierSpec.parse(f"disk:{root}")).direct == "auto"
    with pytest.raises(ConfigError):
        DiskTier.from_spec(TierSpec.parse(f"disk:{root}?direct=sometimes"))
    with pytest.raises(ConfigError, match="capacity"):
        DiskTier.from_spec(TierSpec.parse(f"disk:{root}?capacity=0"))  # as --disk-limit 0 is refused
    with pytest.raises(ConfigError, match="capacity"):
        DiskTier.from_spec(TierSpec.parse(f"disk:{root}?capacity=99999999999999999999999TiB"))
    with pytest.raises(ConfigError, match="workers"):
        DiskTier.from_spec(TierSpec.parse(f"disk:{root}?workers=100000000000000000000"))
