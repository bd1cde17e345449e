"""NixlTier on the real nixl POSIX backend: files in a temporary directory."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tiers.nixl_support import META, SIZES, fetch, file_spec, opened, payload

from lmproto import ObjectMeta
from lmserver.storage.tiers import _diskfile, registry
from lmserver.storage.tiers.base import ConfigError, TierError, Victim
from lmserver.storage.tiers.nixl import NixlTier
from lmserver.storage.tiers.spec import TierSpec

KiB = 1024
MiB = 1024 * KiB


def object_file(root: Path, key: str) -> Path:
    return root / "objects" / _diskfile.object_relpath(_diskfile.object_name(key.encode()))


def truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def flip_slot_body(pool: Path, slot_size: int, key: str) -> None:
    """Flip one body byte of the slot holding ``key``."""
    raw = bytearray(pool.read_bytes())
    for off in range(0, len(raw), slot_size):
        if raw[off : off + 8] == _diskfile.MAGIC:
            header = _diskfile.decode_header(raw[off : off + _diskfile.MAX_HEADER])
            if header.key == key:
                raw[off + header.header_len + 5] ^= 1
    pool.write_bytes(raw)


@pytest.mark.parametrize("direct", [False, True])
async def test_dynamic_round_trips(tmp_path: Path, direct: bool) -> None:
    async with opened(file_spec(tmp_path, capacity="256MiB", direct=direct)) as tier:
        for size in SIZES:
            data = payload(size, seed=size % 251)
            assert await tier.put(f"k{size}", memoryview(data), META)
            assert tier.contains(f"k{size}")
        for size in SIZES:
            got = await fetch(tier, f"k{size}")
            assert got is not None
            assert got[0] == META and got[1] == payload(size, seed=size % 251)
        assert await fetch(tier, "absent") is None
        u = tier.usage()
        assert u.objects == len(SIZES) and u.counters["hits"] == len(SIZES) and u.counters["misses"] == 1
        assert u.counters["puts"] == len(SIZES) and tier.healthy
        assert list(tier.keys("k4")) == ["k4096", "k4194304"]


async def test_dynamic_overwrite_delete_and_capacity(tmp_path: Path) -> None:
    async with opened(file_spec(tmp_path, capacity="310KiB", max_object="300KiB")) as tier:
        for i in range(4):  # 100 KiB bodies + headers: the fourth evicts the first
            assert await tier.put(f"k{i}", memoryview(payload(100 * KiB, i)), META)
        assert not tier.contains("k0") and not object_file(tmp_path, "k0").exists()
        assert tier.usage().counters["evictions"] == 1 and tier.usage().bytes <= 310 * KiB
        other = ObjectMeta(9, 9, (1, 1, 1, 1), 0)
        assert await tier.put("k1", memoryview(b"new"), other)
        assert await fetch(tier, "k1") == (other, bytearray(b"new"))
        assert await tier.delete("k1") and not await tier.delete("k1")
        assert not object_file(tmp_path, "k1").exists() and await fetch(tier, "k1") is None
        # Larger than max_object: declined and counted, nothing evicted.
        assert not await tier.put("big", memoryview(bytearray(400 * KiB)), META)
        assert tier.usage().counters["declined_too_large"] == 1 and tier.contains("k2")


async def test_static_pool_lru_and_slot_reuse(tmp_path: Path) -> None:
    spec = file_spec(tmp_path, layout="static", slot_size="64KiB", slots=3)
    async with opened(spec) as tier:
        for i in range(3):
            assert await tier.put(f"k{i}", memoryview(payload(50 * KiB, i)), META)
        assert (await fetch(tier, "k0")) is not None  # k0 is now the most recently used
        tier.touch("k2")
        assert await tier.put("k3", memoryview(payload(50 * KiB, 3)), META)
        assert sorted(tier.keys()) == ["k0", "k2", "k3"]  # k1 was the LRU slot
        u = tier.usage()
        assert u.counters["evictions"] == 1 and u.objects == 3 and u.bytes == 3 * 64 * KiB
        assert u.capacity == 3 * 64 * KiB
        assert (tmp_path / "slots.pool").stat().st_size == 3 * 64 * KiB  # the pool never grows
        # A slot holds header + body: an object larger than a slot is declined, counted.
        assert not await tier.put("big", memoryview(bytearray(64 * KiB)), META)
        assert tier.usage().counters["declined_too_large"] == 1
        for i in (0, 2, 3):
            got = await fetch(tier, f"k{i}")
            assert got is not None and got[1] == payload(50 * KiB, i)


@pytest.mark.parametrize("layout", ["dynamic", "static"])
async def test_restart_serves_what_was_there(tmp_path: Path, layout: str) -> None:
    capacity = "16KiB" if layout == "dynamic" else "64KiB"  # 16 slots of 4 KiB
    spec = file_spec(tmp_path, layout=layout, capacity=capacity, slot_size="4KiB", direct=layout == "static")
    async with opened(spec) as tier:
        for i in range(5):
            assert await tier.put(f"k{i}", memoryview(payload(700 * (i + 1), i)), META)
        assert await tier.delete("k4")
    async with opened(spec) as tier:
        assert sorted(tier.keys()) == ["k0", "k1", "k2", "k3"]  # the deleted one stays gone
        # LRU order after a restart is the write order: k0 goes first.
        i = 5
        while tier.usage().counters["evictions"] == 0:
            assert await tier.put(f"k{i}", memoryview(payload(500, i)), META)
            i += 1
        assert not tier.contains("k0")
        for i in range(1, 4):
            got = await fetch(tier, f"k{i}")
            assert got is not None and got == (META, payload(700 * (i + 1), i))


async def test_corrupt_and_truncated_objects_are_counted_misses(tmp_path: Path) -> None:
    async with opened(file_spec(tmp_path, capacity="1MiB")) as tier:
        for key in ("flip", "cut", "gone", "ok"):
            assert await tier.put(key, memoryview(payload(8 * KiB)), META)
        path = object_file(tmp_path, "flip")
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(raw)
        truncate(object_file(tmp_path, "cut"), 1000)
        object_file(tmp_path, "gone").unlink()
        for key in ("flip", "cut", "gone"):
            assert await fetch(tier, key) is None
            assert not tier.contains(key)
        assert await fetch(tier, "ok") is not None
        c = tier.usage().counters
        assert (c["corrupt"], c["missing"], c["misses"], c["hits"]) == (2, 1, 3, 1)
        assert not path.exists()  # a corrupt file is removed


async def test_corrupt_slot_is_a_counted_miss_and_not_revived(tmp_path: Path) -> None:
    spec = file_spec(tmp_path, layout="static", slot_size="16KiB", slots=4)
    async with opened(spec) as tier:
        for i in range(3):
            assert await tier.put(f"k{i}", memoryview(payload(10 * KiB, i)), META)
        flip_slot_body(tmp_path / "slots.pool", 16 * KiB, "k1")
        assert await fetch(tier, "k1") is None
        assert tier.usage().counters["corrupt"] == 1 and not tier.contains("k1")
    async with opened(spec) as tier:
        assert sorted(tier.keys()) == ["k0", "k2"]


async def test_static_victims_are_read_at_eviction_and_slots_reused(tmp_path: Path) -> None:
    held: list[Victim] = []
    spec = file_spec(tmp_path, layout="static", slot_size="16KiB", slots=2)
    async with opened(spec) as tier:
        tier.on_evict = held.append
        for i in range(4):
            assert await tier.put(f"k{i}", memoryview(payload(10 * KiB, i)), META)
        assert [v.key for v in held] == ["k0", "k1"]
        for i, victim in enumerate(held):
            data = await asyncio.to_thread(victim.open)
            assert bytes(data) == payload(10 * KiB, i) and victim.meta == META
            victim.release()
            victim.release()  # idempotent
        assert tier.usage().counters["evictions"] == 2 and sorted(tier.keys()) == ["k2", "k3"]


async def test_dynamic_victims_stay_readable_until_released(tmp_path: Path) -> None:
    held: list[Victim] = []
    async with opened(file_spec(tmp_path, capacity="24KiB")) as tier:
        tier.on_evict = held.append
        for i in range(3):
            assert await tier.put(f"k{i}", memoryview(payload(10 * KiB, i)), META)
        assert [v.key for v in held] == ["k0"] and not tier.contains("k0")
        assert object_file(tmp_path, "k0").exists()  # still held: counted in inflight_bytes
        assert tier.usage().counters["inflight_bytes"] > 10 * KiB
        assert bytes(await asyncio.to_thread(held[0].open)) == payload(10 * KiB, 0)
        await asyncio.to_thread(held[0].release)
        assert not object_file(tmp_path, "k0").exists()
        assert tier.usage().counters["inflight_bytes"] == 0


async def test_a_second_server_on_the_directory_is_refused_unless_shared(tmp_path: Path) -> None:
    async with opened(file_spec(tmp_path, capacity="1MiB")):
        with pytest.raises(ConfigError, match="in use"):
            async with opened(file_spec(tmp_path, capacity="1MiB")):
                pass


async def test_shared_directory_serves_what_another_server_wrote(tmp_path: Path) -> None:
    spec = file_spec(tmp_path, capacity="1MiB", shared="true", refresh=0)
    async with opened(spec) as a, opened(spec) as b:
        assert not a.complete_index
        assert await a.put("k", memoryview(b"from a"), META)
        assert not b.contains("k")  # EXIST answers from b's index: not learned yet
        assert await fetch(b, "k") == (META, bytearray(b"from a"))  # a GET probes
        assert b.contains("k") and b.usage().counters["probe_hits"] == 1
        assert await a.put("k2", memoryview(b"two"), META)
        await asyncio.to_thread(b.refresh_sync)
        assert b.contains("k2") and b.usage().counters["refreshed_in"] == 1
        assert await a.delete("k2")
        await asyncio.to_thread(b.refresh_sync)
        assert not b.contains("k2") and b.usage().counters["refreshed_out"] == 1


def test_registry_builds_the_tier(tmp_path: Path) -> None:
    tier, chain = registry.build(TierSpec.parse(file_spec(tmp_path, capacity="1GiB", mode="write-behind")))
    assert isinstance(tier, NixlTier) and chain.mode == "write-behind"
    assert registry.build(TierSpec.parse(file_spec(tmp_path, capacity="1GiB")))[1].mode == "demote"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nixl:{d}", "needs capacity"),
        ("nixl:{d}?capacity=1GiB&colour=blue", "unknown option"),
        ("nixl:{d}?capacity=lots", "a size"),
        ("nixl:{d}?capacity=1GiB&backend=NVMEOF", "one of POSIX, GDS, GDS_MT, OBJ"),
        ("nixl:{d}?layout=static&slot_size=1000&slots=4", "multiple of 4096"),
        ("nixl:{d}?layout=static", "at least one slot"),
        ("nixl:{d}?layout=static&slots=2&capacity=1GiB", "not both"),
        ("nixl:{d}?layout=static&slots=2&shared=true", "layout=dynamic"),
        ("nixl:{d}?capacity=1GiB&backend=OBJ", "s3://"),
        ("nixl:s3://bucket/p?capacity=1GiB&backend=POSIX", "needs a directory"),
        ("nixl:s3://?capacity=1GiB", "s3://BUCKET"),
        ("nixl:{d}?capacity=1GiB&endpoint=http://x", "OBJ only"),
        ("nixl:{d}?capacity=1GiB&timeout=0", "seconds >="),
        ("nixl:{d}?capacity=1GiB&backend=GDS", "libcufile.so.0"),
        ("nixl:{d}?capacity=1GiB&backend=GDS_MT", "GPUDirect Storage"),
    ],
)
def test_bad_options_are_config_errors(tmp_path: Path, spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        registry.build(TierSpec.parse(spec.format(d=tmp_path)))


async def test_backend_params_pass_through_and_bad_ones_fail_at_open(tmp_path: Path) -> None:
    async with opened(file_spec(tmp_path / "u", capacity="1MiB", **{"nixl.use_uring": "true"})) as tier:
        assert await tier.put("k", memoryview(b"x"), META)
        assert await fetch(tier, "k") == (META, bytearray(b"x"))


async def test_closed_tier_declines_and_misses(tmp_path: Path) -> None:
    async with opened(file_spec(tmp_path, capacity="1MiB")) as tier:
        assert await tier.put("k", memoryview(b"x"), META)
    assert not await tier.put("k2", memoryview(b"x"), META)
    assert await tier.get_into("k", bytearray) is None
    assert not await tier.delete("k")
    with pytest.raises(TierError):
        NixlTier._read_victim(tier, "k", tier._index.get("k"))  # type: ignore[arg-type]
