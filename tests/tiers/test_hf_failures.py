"""HFBucketTier when the Hub misbehaves: partial batches, silent drops, lost replies, a
missing bucket, a refused token, 429/5xx, corrupt objects and the Hub going away."""

from __future__ import annotations

import asyncio
import time

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import FakeHub
from fakehub.fixtures import BUCKET, bucket_bytes, eventually

from lmproto import ObjectMeta
from lmserver.storage.tiers import _diskfile
from lmserver.storage.tiers.base import ConfigError
from lmserver.storage.tiers.hf.naming import object_name

META = ObjectMeta(1, 2, (3, 4, 5, 6), 0)


def path(key: str) -> str:
    return f"cache/{object_name(key)}"


async def read(tier, key: str) -> bytes | None:
    got: list[bytearray] = []

    def alloc(n: int) -> memoryview:
        got.append(bytearray(n))
        return memoryview(got[-1])

    meta = await tier.get_into(key, alloc)
    return None if meta is None else bytes(got[-1])


async def put_all(tier, blobs: dict[str, bytes]) -> list[bool]:
    return list(await asyncio.gather(*(tier.put(k, memoryview(v), META) for k, v in blobs.items())))


async def test_partial_batch_failure_is_reconciled(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(window_s=0.2)
    hub.reject = lambda p: "quota exceeded" if p == path("bad") else None
    ok = await put_all(tier, {"good1": b"1" * 100, "bad": b"2" * 200, "good2": b"3" * 300})
    assert ok == [True, False, True]
    usage = tier.usage()
    assert usage.objects == 2 and usage.bytes == bucket_bytes(hub)
    assert usage.counters["batch_partial"] == 1 and usage.counters["write_failures"] == 1
    assert not tier.contains("bad") and usage.counters["is_healthy"]


async def test_silently_dropped_adds_are_caught(hub: FakeHub, make_tier) -> None:
    # huggingface_hub 1.5-1.32 ignored a 200's failure list: model it as an op that vanishes.
    tier = await make_tier(window_s=0.2)
    hub.silently_drop = lambda p: p == path("lost")
    assert await put_all(tier, {"kept": b"k" * 10, "lost": b"l" * 10}) == [True, False]
    assert tier.usage().bytes == bucket_bytes(hub) and tier.usage().objects == 1


async def test_a_lost_reply_after_the_batch_landed_still_counts(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    hub.fail_after_batch = 10  # applied every time, 500 every time (retried 5 times, then raised)
    assert await tier.put("k", memoryview(b"x" * 1000), META)
    usage = tier.usage()
    assert usage.counters["reconciled"] == 1 and usage.objects == 1 and usage.bytes == bucket_bytes(hub)
    assert not tier.healthy  # the batch route kept failing: unhealthy until a probe succeeds
    await eventually(lambda: tier.healthy, "recovery")
    assert await read(tier, "k") == b"x" * 1000


async def test_missing_bucket_is_a_startup_error_unless_created(hub: FakeHub, make_tier) -> None:
    with pytest.raises(ConfigError, match="not found"):
        await make_tier("hf://buckets/lmtest/absent")
    tier = await make_tier("hf://buckets/lmtest/absent/p", create=True)
    assert "lmtest/absent" in hub.buckets
    assert await tier.put("k", memoryview(b"v"), META)
    assert list(hub.files("lmtest/absent")) == [f"p/{object_name('k')}"]


async def test_refused_token_is_a_startup_error(hub: FakeHub, make_tier) -> None:
    with pytest.raises(ConfigError, match="refused the token") as info:
        await make_tier(token="hf_wrong_secret")
    assert "hf_wrong_secret" not in str(info.value)


async def test_rate_limit_is_retried_after_the_servers_delay(hub: FakeHub, make_tier, no_backoff) -> None:
    tier = await make_tier()
    hub.fail("batch", 429, times=2, headers={"Retry-After": "7"})
    assert await tier.put("k", memoryview(b"v" * 10), META)
    assert no_backoff.count(8.0) == 2  # Retry-After + 1 s, as huggingface_hub waits
    assert tier.healthy


async def test_server_errors_make_the_tier_unhealthy_until_a_probe_succeeds(
    hub: FakeHub,
    make_tier,
) -> None:
    tier = await make_tier()
    assert await tier.put("old", memoryview(b"o" * 10), META)
    hub.fail("batch", 503, times=6)  # more than huggingface_hub's 5 retries
    hub.fail("paths-info", 503, times=6)
    assert not await tier.put("k", memoryview(b"v" * 10), META)
    usage = tier.usage()
    assert not tier.healthy and usage.counters["is_healthy"] is False and usage.counters["failures"] >= 1
    # While unhealthy: writes are dropped and counted, reads miss at once, EXIST still answers.
    assert not await tier.put("k2", memoryview(b"v"), META)
    assert tier.usage().counters["dropped_unhealthy"] == 1
    assert tier.contains("old") and await read(tier, "old") is None
    assert tier.usage().counters["misses_unhealthy"] == 1
    await eventually(lambda: tier.healthy, "the refresh thread's probe")
    assert await tier.put("k", memoryview(b"v" * 10), META)
    assert tier.usage().bytes == bucket_bytes(hub)


async def test_hub_going_away_and_coming_back(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    assert await tier.put("before", memoryview(b"b" * 100), META)
    hub.stop()
    assert not await tier.put("during", memoryview(b"d" * 100), META)
    assert not tier.healthy
    assert tier.contains("before") and not tier.contains("during")
    hub.start()  # same port
    await eventually(lambda: tier.healthy, "recovery")
    assert await tier.put("after", memoryview(b"a" * 100), META)
    assert await read(tier, "before") == b"b" * 100
    assert tier.usage().bytes == bucket_bytes(hub)


def _object(key: str, body: bytes, *, crc: int | None = None) -> bytes:
    k = key.encode()
    crc = _diskfile.checksum(body) if crc is None else crc
    return _diskfile.encode_header(k, len(body), crc, META, 0) + body


async def test_corrupt_objects_are_counted_misses_and_dropped(hub: FakeHub, make_tier) -> None:
    from fakehub import TOKEN
    from huggingface_hub import HfApi

    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    good = _object("good", b"g" * 500)
    bad_crc = _object("badcrc", b"c" * 500, crc=12345)
    truncated = _object("short", b"s" * 500)[:-100]
    wrong_key = _object("other", b"w" * 10)
    api.batch_bucket_files(
        BUCKET,
        add=[
            (good, path("good")),
            (bad_crc, path("badcrc")),
            (truncated, path("short")),
            (wrong_key, path("wrongkey")),
        ],
    )
    tier = await make_tier()
    assert tier.usage().objects == 4
    assert await read(tier, "good") == b"g" * 500
    for key in ("badcrc", "short", "wrongkey"):
        assert tier.contains(key)
        assert await read(tier, key) is None
        assert not tier.contains(key)
    usage = tier.usage()
    assert usage.counters["corrupt"] == 3 and usage.counters["hits"] == 1 and usage.objects == 1
    await eventually(lambda: set(hub.files(BUCKET)) == {path("good")}, "corrupt objects deleted")
    await eventually(lambda: tier.usage().bytes == bucket_bytes(hub), "doomed bytes forgotten")


async def test_pending_writes_are_bounded(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(max_pending=10_000, window_s=0.3)
    results = await put_all(tier, {f"k{i}": b"x" * 4000 for i in range(4)})
    assert results.count(True) == 2
    assert tier.usage().counters["dropped_queue_full"] == 2
    assert tier.usage().bytes == bucket_bytes(hub)


async def test_exhausted_rate_limit_backs_off_as_long_as_the_hub_asks(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    hub.fail("batch", 429, times=6, headers={"Retry-After": "120"})
    assert not await tier.put("k", memoryview(b"v"), META)
    assert not tier.healthy
    assert tier._retry_at - time.monotonic() > 100  # Retry-After, not the 1 s first backoff
    assert not await tier.put("k2", memoryview(b"v"), META)
    assert tier.usage().counters["dropped_unhealthy"] == 1


async def test_a_revoked_token_is_reported_and_never_logged(hub: FakeHub, make_tier) -> None:
    from fakehub import TOKEN
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        tier = await make_tier()
        hub.token = "hf_a_newer_token"  # the server's token no longer works
        assert not await tier.put("k", memoryview(b"v"), META)
        assert not tier.healthy
        hub.token = TOKEN
        await eventually(lambda: tier.healthy, "recovery once the token works again")
    assert any(entry.get("kind") == "unauthorized" for entry in logs)
    assert TOKEN not in repr(logs)


async def test_close_with_operations_in_flight(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(window_s=0.2)
    assert await tier.put("old", memoryview(b"o" * 1000), META)
    puts = [asyncio.ensure_future(tier.put(f"k{i}", memoryview(b"x" * 1000), META)) for i in range(10)]
    gets = [asyncio.ensure_future(read(tier, "old")) for _ in range(5)]
    await asyncio.sleep(0.05)
    await tier.close()
    results = await asyncio.gather(*puts, *gets)
    assert all(r in (True, False) for r in results[:10])
    assert all(r in (b"o" * 1000, None) for r in results[10:])
    assert not await tier.put("late", memoryview(b"v"), META)
    assert await read(tier, "old") is None
    assert tier.usage().bytes == bucket_bytes(hub)  # what was queued was committed


async def test_a_hub_that_never_answers_times_out(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(timeout_s=0.3)
    hub.delays["paths-info"] = 2.0  # the batch lands, the reconciliation hangs
    assert not await tier.put("k", memoryview(b"v" * 100), META)
    assert not tier.healthy and tier.usage().counters["write_failures"] == 1
    assert tier.usage().objects == 0  # unknown outcome: not counted ...
    hub.delays.clear()
    await eventually(lambda: tier.healthy, "recovery")
    await asyncio.to_thread(tier._sync_listing)  # ... until the next listing finds it
    assert tier.contains("k") and tier.usage().bytes == bucket_bytes(hub)


async def test_a_hub_unreachable_at_start_is_retried(hub: FakeHub, make_tier) -> None:
    hub.stop()
    tier = await make_tier("hf://buckets/lmtest/later/p", create=True)  # starts, unhealthy
    assert not tier.healthy and tier.usage().objects == 0
    hub.start()
    await eventually(lambda: tier.healthy and tier._listed, "the bucket created and listed")
    assert "lmtest/later" in hub.buckets
    assert await tier.put("k", memoryview(b"v"), META)
