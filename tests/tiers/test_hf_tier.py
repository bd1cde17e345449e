"""HFBucketTier through its async API, driving the real HfApi and hf_xet against the fake Hub."""

from __future__ import annotations

import asyncio
import os

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import FakeHub
from fakehub.fixtures import BUCKET

from lmproto import ObjectMeta
from lmserver.storage.tiers.base import ConfigError
from lmserver.storage.tiers.hf import parse_handle
from lmserver.storage.tiers.hf.naming import object_name

META = ObjectMeta(1, 2, (3, 4, 5, 6), 0)


def alloc_into(store: dict[str, bytearray], key: str = "last"):
    def alloc(n: int) -> memoryview:
        store[key] = bytearray(n)
        return memoryview(store[key])

    return alloc


async def read(tier, key: str) -> bytes | None:
    got: dict[str, bytearray] = {}
    meta = await tier.get_into(key, alloc_into(got))
    if meta is None:
        return None
    assert meta == META
    return bytes(got["last"])


@pytest.mark.parametrize(
    "text, bucket, prefix",
    [
        ("hf://buckets/ns/b", "ns/b", ""),
        ("  hf://buckets/ns/b/  ", "ns/b", ""),
        ("hf://buckets/ns//b//p/q/", "ns/b", "p/q"),
    ],
)
def test_handles_parse_like_lmcache(text: str, bucket: str, prefix: str) -> None:
    h = parse_handle(text)
    assert (h.bucket_id, h.prefix) == (bucket, prefix)


@pytest.mark.parametrize(
    "text", ["hf://buckets/ns", "hf://buckets/", "s3://buckets/a/b", "hf://models/a/b", ""]
)
def test_bad_handles_are_config_errors(text: str) -> None:
    with pytest.raises(ConfigError):
        parse_handle(text)


@pytest.mark.parametrize("piece", [1 << 20, 3 << 20])
async def test_round_trips_from_empty_to_32_mib(hub: FakeHub, make_tier, piece: int) -> None:
    tier = await make_tier(read_piece=piece)
    sizes = [0, 1, 4095, 64 << 10, 1 << 20, 32 << 20]
    blobs = {f"key-{n}": os.urandom(n) for n in sizes}
    results = await asyncio.gather(*(tier.put(k, memoryview(v), META) for k, v in blobs.items()))
    assert all(results)
    for key, blob in blobs.items():
        assert tier.contains(key)
        assert await read(tier, key) == blob
    usage = tier.usage()
    assert usage.objects == len(sizes)
    assert usage.bytes == sum(f.size for f in hub.files(BUCKET).values())
    assert usage.counters["puts"] == len(sizes) and usage.counters["hits"] == len(sizes)
    assert usage.counters["batches"] < len(sizes)  # concurrent puts shared commits
    assert sorted(tier.keys("key-")) == sorted(blobs)
    assert usage.counters["is_healthy"] is True


async def test_object_paths_are_hashes_of_the_key(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    hostile = "../../etc/passwd\x00" + "é" * 60 + "/" * 20
    assert await tier.put(hostile, memoryview(b"v"), META)
    assert list(hub.files(BUCKET)) == [f"cache/{object_name(hostile)}"]
    assert await read(tier, hostile) == b"v"


async def test_overwrite_and_delete(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    assert await tier.put("k", memoryview(b"a" * 100), META)
    assert await tier.put("k", memoryview(b"b" * 300), META)
    assert await read(tier, "k") == b"b" * 300
    assert tier.usage().objects == 1
    assert tier.usage().bytes == next(iter(hub.files(BUCKET).values())).size
    assert await tier.delete("k")
    assert not tier.contains("k")
    assert await read(tier, "k") is None
    assert not await tier.delete("k")
    await asyncio.sleep(0)
    for _ in range(200):  # the delete is committed by the batcher
        if not hub.files(BUCKET):
            break
        await asyncio.sleep(0.02)
    assert hub.files(BUCKET) == {}
    assert tier.usage().bytes == 0


async def test_restart_learns_the_bucket(hub: FakeHub, make_tier) -> None:
    first = await make_tier()
    blobs = {f"k{i}": os.urandom(1000 + i) for i in range(5)}
    await asyncio.gather(*(first.put(k, memoryview(v), META) for k, v in blobs.items()))
    await first.close()
    again = await make_tier()
    usage = again.usage()
    assert usage.objects == 5 and usage.bytes == sum(f.size for f in hub.files(BUCKET).values())
    assert all(again.contains(k) for k in blobs)
    for key, blob in blobs.items():
        assert await read(again, key) == blob
    assert sorted(again.keys()) == sorted(blobs)  # keys learned from headers on read


async def test_two_tiers_share_a_bucket(hub: FakeHub, make_tier) -> None:
    writer = await make_tier()
    reader = await make_tier(refresh_s=0.2)
    assert not reader.contains("shared")
    assert await writer.put("shared", memoryview(b"s" * 5000), META)
    for _ in range(200):
        if reader.contains("shared"):
            break
        await asyncio.sleep(0.05)
    assert reader.contains("shared")
    assert await read(reader, "shared") == b"s" * 5000
    assert not reader.complete_index
    # keys of objects others wrote are learned in the background for LIST
    for _ in range(200):
        if reader.keys() == ["shared"]:
            break
        await asyncio.sleep(0.05)
    assert reader.keys() == ["shared"]
    assert await writer.delete("shared")
    for _ in range(200):
        if not reader.contains("shared"):
            break
        await asyncio.sleep(0.05)
    assert not reader.contains("shared")
    assert reader.usage().counters["removed_by_others"] == 1


async def test_metadata_the_format_cannot_hold_is_declined(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    assert not await tier.put("k", memoryview(b"v"), ObjectMeta(1, 2, (1, 2, 3), 0))
    assert not await tier.put("x" * 5000, memoryview(b"v"), META)
    usage = tier.usage()
    assert usage.counters["declined_invalid"] == 2
    assert (usage.objects, usage.bytes, usage.counters["pending_bytes"]) == (0, 0, 0)
    assert tier._index.reserved == 0 and hub.files(BUCKET) == {}


async def test_another_instances_overwrite_is_seen_after_a_refresh(hub: FakeHub, make_tier) -> None:
    writer = await make_tier()
    reader = await make_tier()  # refresh only when told, to see both sides of it
    assert await writer.put("k", memoryview(b"1" * 100), META)
    await asyncio.to_thread(reader._sync_listing)
    assert await read(reader, "k") == b"1" * 100
    assert await writer.put("k", memoryview(b"2" * 300), META)
    # Before the refresh: the version this reader indexed (whole and verified), never a mix.
    assert await read(reader, "k") == b"1" * 100
    await asyncio.to_thread(reader._sync_listing)
    assert await read(reader, "k") == b"2" * 300
    assert reader.usage().bytes == writer.usage().bytes == next(iter(hub.files(BUCKET).values())).size
