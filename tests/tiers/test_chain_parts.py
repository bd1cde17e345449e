"""The parts the tier chain stands on, one at a time: disk victims handed off on eviction,
the shared LRU index, tier specs, and the memory pool's lent share."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disktier import allocated, flip_byte

from lmproto import ObjectMeta
from lmserver.storage.memory import OBJECT_OVERHEAD, MemoryTier, MemoryVictim
from lmserver.storage.pool import BufferPool
from lmserver.storage.tiers.base import ConfigError, TierError, Victim
from lmserver.storage.tiers.disk import HELD_SHARE, DiskTier
from lmserver.storage.tiers.lru_index import LRUIndex
from lmserver.storage.tiers.spec import TierSpec, chain_options

META = ObjectMeta(fmt=1, dtype=3, shape=(2, 16, 256, 128), location=1)
KiB = 1024


def body(i: int, n: int = 64 * KiB) -> bytes:
    return bytes([i % 251]) * n


# -- disk victims -------------------------------------------------------------------------


class Taker:
    def __init__(self) -> None:
        self.victims: list[Victim] = []

    def __call__(self, victim: Victim) -> None:
        self.victims.append(victim)


@contextlib.asynccontextmanager
async def evicting_disk(root: Path, held_objects: int) -> AsyncIterator[tuple[DiskTier, Taker]]:
    """A disk tier that has evicted (and handed off) some of 40 objects of 64 KiB."""
    tier = DiskTier(root, capacity=HELD_SHARE * held_objects * 100 * KiB)
    await tier.open()
    taker = Taker()
    tier.on_evict = taker
    try:
        for i in range(40):
            assert await tier.put(f"k{i}", memoryview(body(i)), META)
        yield tier, taker
    finally:
        for victim in taker.victims:
            victim.release()
        await tier.close()


async def test_disk_eviction_hands_off_a_verified_victim(tmp_path: Path) -> None:
    async with evicting_disk(tmp_path, held_objects=2) as (tier, taker):
        assert taker.victims, "the disk evicted nothing"
        victim = taker.victims[0]
        assert (victim.key, victim.length, victim.meta) == ("k0", 64 * KiB, META)
        assert not tier.contains("k0")  # gone from the index at once
        held = tier.usage().counters["held_bytes"]
        assert held > 0
        await tier.settle()
        assert allocated(tmp_path) == tier.usage().bytes + held  # the record stays until released
        view = victim.open()
        assert bytes(view) == body(0)
        victim.release()
        view.release()
        victim.release()  # idempotent
        for other in taker.victims[1:]:
            other.release()
        assert tier.usage().counters["held_bytes"] == 0
        await tier.settle()
        assert allocated(tmp_path) == tier.usage().bytes  # and is given back after
        with pytest.raises(TierError):
            victim.open()


async def test_a_corrupt_victim_is_refused_never_demoted(tmp_path: Path) -> None:
    async with evicting_disk(tmp_path, held_objects=2) as (tier, taker):
        victim = taker.victims[0]
        rec = victim.record  # type: ignore[attr-defined]
        flip_byte(Path(tier._segments.path_of(rec.segment)), rec.offset + rec.header_len + 10)
        with pytest.raises(TierError):
            victim.open()
        assert tier.usage().counters["corrupt"] == 1


async def test_victims_beyond_the_held_share_are_dropped_and_counted(tmp_path: Path) -> None:
    async with evicting_disk(tmp_path, held_objects=1) as (tier, taker):
        assert len(taker.victims) == 1  # never released: the share stays full
        assert tier.usage().counters["demotions_dropped"] > 0
        usage = tier.usage()
        assert usage.bytes + usage.counters["held_bytes"] <= usage.capacity


async def test_records_held_at_close_are_given_back_at_the_next_open(tmp_path: Path) -> None:
    """A tier closed (or killed) while the next tier still held some of its victims: their
    rows are gone, their records are not; the next open gives their space back."""
    async with evicting_disk(tmp_path, held_objects=2) as (tier, taker):
        held = taker.victims[:]
        taker.victims.clear()  # not released before the close
        assert held
    for victim in held:
        with contextlib.suppress(TierError):
            victim.release()
    tier = DiskTier(tmp_path, capacity=1 << 30)
    await tier.open()
    try:
        await tier.settle()
        assert allocated(tmp_path) == tier.usage().bytes
        assert not any(tier.contains(v.key) for v in held)
    finally:
        await tier.close()


# -- the LRU index --------------------------------------------------------------------------


class Rec:
    def __init__(self, size: int) -> None:
        self.size = size


def test_lru_index_evicts_least_recently_used_and_keeps_the_invariant() -> None:
    index: LRUIndex[Rec] = LRUIndex(300)
    for key in "abc":
        assert index.reserve(100) == []
        index.commit(key, Rec(100), 100)
    assert index.touch("a")
    victims = index.reserve(100)
    assert victims is not None and [k for k, _ in victims] == ["b"]  # a was touched
    assert index.bytes + index.reserved + index.doomed <= index.capacity
    index.commit("d", Rec(100), 100)
    index.hold(100)  # "b" kept for demotion: the next reservation evicts more to cover it
    victims = index.reserve(100)
    assert victims is not None and [k for k, _ in victims] == ["c", "a"]
    index.forget(100)
    index.cancel(100)
    assert index.keys() == ["d"]
    assert index.keys("d") == ["d"]
    assert index.bytes + index.reserved + index.doomed <= index.capacity


def test_lru_index_refuses_what_in_flight_work_blocks() -> None:
    index: LRUIndex[Rec] = LRUIndex(200)
    assert index.reserve(150) == []
    assert index.reserve(100) is None  # 150 reserved: evicting everything cannot help
    index.cancel(150)
    assert index.reserve(200) == []


def test_lru_index_remove_only_the_given_version() -> None:
    index: LRUIndex[Rec] = LRUIndex(1000)
    old, new = Rec(10), Rec(20)
    index.commit("k", old, 0)
    index.commit("k", new, 0)
    assert index.remove("k", old) is None  # a newer version: left alone
    assert index.remove("k", new) is new
    assert index.doomed == 20
    index.load("x", Rec(5))
    index.load("x", Rec(7))  # loading twice counts once
    assert index.bytes == 7


def test_lru_index_overflow_after_a_lower_capacity() -> None:
    index: LRUIndex[Rec] = LRUIndex(1000)
    for key in "abcde":
        index.load(key, Rec(100))
    index.capacity = 250
    assert [k for k, _ in index.overflow()] == ["a", "b", "c"]


# -- specs ------------------------------------------------------------------------------------


def test_spec_getters_and_typos() -> None:
    spec = TierSpec.parse("disk:/d?capacity=1GiB&workers=3&direct=yes&timeout=2.5&mode=demote&queue=8MiB")
    assert spec.size("capacity", 0) == 1 << 30
    assert spec.integer("workers", 1) == 3
    assert spec.flag("direct", False) is True
    assert spec.seconds("timeout", 1.0) == 2.5
    options = chain_options(spec, "write-behind")
    assert (options.mode, options.queue_bytes) == ("demote", 8 << 20)
    spec.finish()
    typo = TierSpec.parse("disk:/d?capcity=1GiB")
    typo.size("capacity", 0)
    with pytest.raises(ConfigError, match="capcity"):
        typo.finish()


@pytest.mark.parametrize(
    ("text", "getter"),
    [
        ("k:/?n=-1", lambda s: s.integer("n", 0)),
        ("k:/?n=x", lambda s: s.integer("n", 0)),
        ("k:/?t=nan", lambda s: s.seconds("t", 0.0)),
        ("k:/?f=maybe", lambda s: s.flag("f", False)),
        ("k:/?c=purple", lambda s: s.choice("c", ("red", "blue"), "red")),
        ("k:/?s=big", lambda s: s.size("s", 0)),
        ("k:/?s=99999999999999999999999TiB", lambda s: s.size("s", 0)),  # above 1 EiB
        ("k:/?s=0", lambda s: s.size("s", 1, minimum=1)),
        ("k:/?n=100000000000000000000", lambda s: s.integer("n", 1)),  # above MAX_COUNT
        ("k:/?n=5", lambda s: s.integer("n", 1, maximum=4)),
    ],
)
def test_spec_bad_values_name_the_option(text: str, getter) -> None:
    with pytest.raises(ConfigError, match=text.split("?")[1].split("=")[0]):
        getter(TierSpec.parse(text))


def test_secret_options_are_masked() -> None:
    spec = TierSpec.parse("nixl:s3://b/p?access_key=a&secret_key=s3cr3t&token=t0k&session_password=pw&x=1")
    assert str(spec) == "nixl:s3://b/p?access_key=a&secret_key=***&token=***&session_password=***&x=1"


# -- the memory pool's lent share -----------------------------------------------------------


def test_pool_lending_frees_room_within_the_capacity() -> None:
    pool = BufferPool(64 * KiB)
    pool.set_lend_limit(16 * KiB)
    bufs = [pool.acquire(16 * KiB) for _ in range(3)]
    assert all(b is not None for b in bufs)
    assert pool.acquire(16 * KiB) is None  # 48 KiB in use: the rest is the lent share
    assert pool.lend(bufs[0])
    assert pool.in_use + pool.lent <= pool.capacity
    fourth = pool.acquire(16 * KiB)
    assert fourth is not None
    assert not pool.lend(bufs[1])  # the lent share is full
    pool.release(bufs[0], lent=True)
    assert pool.lent == 0
    assert pool.in_use + pool.lent + pool.idle <= pool.capacity


def test_memory_eviction_lends_the_victim_to_the_taker() -> None:
    memory = MemoryTier(64 * KiB + 3 * OBJECT_OVERHEAD, shards=2)  # 3 objects beside the lent share
    memory.pool.set_lend_limit(16 * KiB)
    taken: list[MemoryVictim] = []
    memory.on_evict = taken.append
    for i in range(4):
        entry = memory.reserve(16 * KiB)
        assert entry is not None
        entry.buffer[: 16 * KiB] = body(i, 16 * KiB)
        memory.commit(f"k{i}", entry, META)
    assert [v.key for v in taken] == ["k0"]
    assert bytes(taken[0].open()) == body(0, 16 * KiB)
    assert memory.pool.lent == 16 * KiB
    entry = memory.reserve(16 * KiB)  # the share is full now: this victim is dropped, counted
    assert entry is not None
    assert memory.counters.demotions_dropped == 1
    taken[0].release()
    assert memory.pool.lent == 0
