"""HFBucketTier's capacity: watermark eviction, victims handed off for demotion, deletes that
wait for readers, and configuration from a ``--tier`` spec."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import FakeHub
from fakehub.fixtures import BUCKET, HANDLE, bucket_bytes, eventually

from lmproto import ObjectMeta
from lmserver.storage.tiers import registry
from lmserver.storage.tiers.base import ConfigError, TierError, Victim
from lmserver.storage.tiers.hf import HFBucketTier
from lmserver.storage.tiers.hf.naming import object_name
from lmserver.storage.tiers.spec import TierSpec

META = ObjectMeta(1, 2, (3, 4, 5, 6), 0)
OBJ = 10_000
HEADER = 84 + 2  # keys "kN"


async def test_watermark_eviction_hands_victims_off(hub: FakeHub, make_tier) -> None:
    size = OBJ + HEADER
    tier = await make_tier(capacity=10 * size, trigger=0.8, ratio=0.5)
    taken: list[Victim] = []
    tier.on_evict = taken.append
    for i in range(8):
        assert await tier.put(f"k{i}", memoryview(bytes([i]) * OBJ), META)
        tier.touch("k0")  # k0 stays recently used
    # Past 8 objects (= trigger): evicted down to 3 in LRU order, k0 kept.
    usage = tier.usage()
    assert usage.objects == 3 and usage.counters["evictions"] == 5
    assert tier.contains("k0") and not tier.contains("k1")
    assert sorted(v.key for v in taken) == ["k1", "k2", "k3", "k4", "k5"]
    victim = next(v for v in taken if v.key == "k3")
    assert (victim.length, victim.meta) == (OBJ, META)
    assert bytes(await asyncio.to_thread(victim.open)) == bytes([3]) * OBJ
    assert len(hub.files(BUCKET)) == 8  # held victims stay in the bucket until released
    await asyncio.to_thread(tier._sync_listing)  # ... and a listing does not take them back
    assert tier.usage().objects == 3 and tier.usage().counters["learned_from_bucket"] == 0
    for v in taken:
        await asyncio.to_thread(v.release)
        v.release()  # idempotent
    await eventually(lambda: len(hub.files(BUCKET)) == 3, "victims deleted")
    await eventually(lambda: tier._index.doomed == 0, "doomed bytes forgotten")
    assert tier.usage().bytes == bucket_bytes(hub)


async def test_capacity_is_never_exceeded(hub: FakeHub, make_tier) -> None:
    size = OBJ + HEADER
    tier = await make_tier(capacity=4 * size, trigger=1.0, ratio=0.25)
    results = await asyncio.gather(*(tier.put(f"k{i}", memoryview(b"x" * OBJ), META) for i in range(12)))
    # Writes in flight hold their space: what cannot fit now is declined, never over-booked.
    assert results.count(True) >= 4
    assert tier.usage().counters["declined_no_space"] == results.count(False)
    for i in range(12, 20):  # one at a time, each evicts what it needs
        assert await tier.put(f"k{i}", memoryview(b"x" * OBJ), META)
        assert tier.usage().bytes <= 4 * size
    assert tier.contains("k19") and not tier.contains("k0")
    await eventually(lambda: bucket_bytes(hub) <= 4 * size, "evicted objects deleted")
    assert not await tier.put("huge", memoryview(b"x" * (5 * size)), META)
    assert tier.usage().counters["declined_too_large"] == 1


async def test_delete_waits_for_readers(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    assert await tier.put("k", memoryview(b"r" * OBJ), META)
    deleted: list[asyncio.Task[bool]] = []

    def alloc(n: int) -> memoryview:
        # The read is under way: delete the key now, before the body is downloaded.
        deleted.append(asyncio.get_running_loop().create_task(tier.delete("k")))
        return memoryview(bytearray(n))

    record = tier._index.get(object_name("k"))
    assert await tier.get_into("k", alloc) == META
    assert await deleted[0]
    assert not tier.contains("k") and record.readers == 0
    await eventually(lambda: not hub.files(BUCKET), "the delete after the last read")


async def test_victim_open_fails_cleanly_when_the_object_is_corrupt(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(capacity=2 * (OBJ + HEADER), trigger=1.0, ratio=0.5)
    taken: list[Victim] = []
    tier.on_evict = taken.append
    assert await tier.put("k0", memoryview(b"a" * OBJ), META)
    record = tier._index.get(object_name("k0"))
    assert await tier.put("k1", memoryview(b"b" * OBJ), META)
    assert await tier.put("k2", memoryview(b"c" * OBJ), META)
    assert taken[0].key == "k0"
    record.xet_hash = tier._index.get(object_name("k2")).xet_hash  # now points at other bytes
    with pytest.raises(TierError):
        await asyncio.to_thread(taken[0].open)
    for victim in taken:
        victim.release()


async def test_from_spec_reads_every_option(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("MY_TOKEN", "hf_from_env")
    spec = TierSpec.parse(
        f"{HANDLE}?token_env=MY_TOKEN&token=hf_ignored&create=true&capacity=1GiB&trigger=0.9&ratio=0.3"
        f"&refresh=5&workers=2&batch=16&batch_bytes=64MiB&window=0.02&max_pending=512MiB"
        f"&cache_dir={tmp_path}/c&read=file&timeout=30&private=false&endpoint={hub.endpoint}&mode=demote"
        "&learn_keys=false&name=hf-shared&read_piece=4MiB"
    )
    tier, chain = registry.build(spec)
    assert isinstance(tier, HFBucketTier) and chain.mode == "demote" and tier.name == "hf-shared"
    assert tier.handle.bucket_id == BUCKET and tier.handle.prefix == "cache"
    assert tier._token == "hf_from_env" and tier._endpoint == hub.endpoint
    o = tier.opts
    assert (o.capacity, o.trigger, o.ratio, o.refresh_s, o.workers) == (1 << 30, 0.9, 0.3, 5.0, 2)
    assert (o.batch_ops, o.batch_bytes, o.window_s, o.max_pending) == (16, 64 << 20, 0.02, 512 << 20)
    assert (o.create, o.private, o.read_mode, o.timeout_s) == (True, False, "file", 30.0)
    assert o.cache_dir == f"{tmp_path}/c" and not o.learn_keys and o.read_piece == 4 << 20
    monkeypatch.delenv("MY_TOKEN")
    tier2, _ = registry.build(TierSpec.parse(f"{HANDLE}?token_env=MY_TOKEN&token=hf_option"))
    assert tier2._token == "hf_option"
    await tier.close()
    await tier2.close()


@pytest.mark.parametrize(
    "text",
    [
        "hf://buckets/only-namespace",
        f"{HANDLE}?capacity=lots",
        f"{HANDLE}?trigger=1.5",
        f"{HANDLE}?ratio=0",
        f"{HANDLE}?trigger=0.5&ratio=0.6",
        f"{HANDLE}?read=mmap",
        f"{HANDLE}?tokn=typo",
    ],
)
def test_bad_specs_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError) as info:
        registry.build(TierSpec.parse(text + ("&" if "?" in text else "?") + "token=hf_secret_value"))
    assert "hf_secret_value" not in str(info.value)


async def test_startup_listing_pages_through_a_large_bucket(hub: FakeHub, make_tier) -> None:
    # Listing only needs the Hub's records (no bytes): 2500 objects span three pages.
    from fakehub import FileRec

    with hub.lock:
        files = hub.buckets[BUCKET]
        for i in range(2500):
            files[f"cache/{object_name(f'big{i}')}"] = FileRec(1000, f"{i:064x}", mtime=1000.0 + i)
        files["cache/not-an-object.txt"] = FileRec(5, "f" * 64, mtime=0.0)
        files[f"other/{object_name('elsewhere')}"] = FileRec(5, "e" * 64, mtime=0.0)
    tier = await make_tier(capacity=2000 * 1000, trigger=1.0, ratio=0.1, learn_keys=False)
    usage = tier.usage()
    # Over capacity at start: the oldest (by mtime) were evicted down to the low watermark.
    assert usage.objects == 1800 and usage.bytes == 1800 * 1000
    assert usage.counters["evictions"] == 700
    assert tier.contains("big2499") and not tier.contains("big0")
    assert not tier.contains("elsewhere")
    tree_pages = sum(1 for name, _ in hub.requests if name == "tree")
    assert tree_pages == 3
    await eventually(lambda: len(hub.files(BUCKET)) == 1802, "evicted objects deleted")


def test_a_missing_extra_is_a_config_error_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "hf_xet" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"lmserver\[hf\]"):
        registry.build(TierSpec.parse(HANDLE))
