"""MemoryTier and BufferPool directly: capacity accounting, pins, LRU, reuse, threads."""

from __future__ import annotations

import ctypes
import os
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmproto import NO_META, ObjectMeta
from lmserver._framed import ReplyBuffer
from lmserver.connection.replies import ReplyCopier
from lmserver.storage.memory import OBJECT_OVERHEAD, Entry, MemoryTier
from lmserver.storage.pool import FIRST_SLAB_BYTES, SLAB_BYTES, BufferPool, populate, size_class

KiB = 1024
MiB = 1024 * KiB
SLOT = 4096 + OBJECT_OVERHEAD
"""What one object of up to 4 KiB costs the tier's capacity: its buffer and its metadata."""


def store(tier: MemoryTier, key: str, data: bytes, meta: ObjectMeta = NO_META) -> None:
    entry = tier.reserve(len(data))
    assert entry is not None
    entry.buffer[: len(data)] = data
    tier.commit(key, entry, meta)


@pytest.mark.parametrize("length", [0, 1, 4096, 4097, 64 * KiB, 3 * MiB + 5, 32 * MiB, 2**31 - 1])
def test_size_classes_fit_and_waste_little(length: int) -> None:
    cls = size_class(length)
    assert cls >= length
    assert cls - length <= max(4096, length // 16)  # a page, or 1/16 of the object


def test_pool_reuses_buffers_and_never_exceeds_capacity() -> None:
    pool = BufferPool(8 * MiB)
    first = pool.acquire(MiB)
    assert first is not None
    pool.release(first)
    again = pool.acquire(MiB)
    assert again is first and pool.reuses == 1
    held = [pool.acquire(MiB) for _ in range(7)]
    assert all(b is not None for b in held)
    assert pool.acquire(MiB) is None  # 8 MiB handed out
    for b in held:
        pool.release(b)  # type: ignore[arg-type]
    # Idle buffers of another class are dropped to make room for a new class.
    big = pool.acquire(6 * MiB)
    assert big is not None and pool.in_use + pool.idle <= pool.capacity


def test_idle_buffers_unused_for_an_interval_are_trimmed() -> None:
    pool = BufferPool(16 * MiB)
    buffers = [pool.acquire(MiB) for _ in range(6)]
    for b in buffers:
        pool.release(b)  # type: ignore[arg-type]
    assert pool.trim_unused() == 0  # the first call only starts the interval
    again = [pool.acquire(MiB) for _ in range(2)]  # a steady workload uses 2 of the 6
    for b in again:
        pool.release(b)  # type: ignore[arg-type]
    assert pool.trim_unused() == 4 * MiB
    assert pool.idle == 2 * MiB and pool.in_use == 0
    assert pool.acquire(MiB) is not None and pool.reuses == 3


def test_lru_eviction_order_and_recency_rules() -> None:
    tier = MemoryTier(4 * SLOT, shards=4)
    for key in "abcd":
        store(tier, key, b"x" * 4096)
    hit = tier.get("a")  # a use: refreshes recency
    assert hit is not None
    tier.unpin(hit)
    assert tier.contains("b")  # a lookup: does not
    store(tier, "e", b"y" * 4096)
    assert not tier.contains("b") and tier.contains("a")
    assert tier.counters.evictions == 1


def _check_recency_order(tier: MemoryTier) -> list[str]:
    """Every shard's dict is in recency order (ticks rising); returns all keys."""
    keys = []
    for shard in tier._shards:
        ticks = [entry.tick for entry in shard.entries.values()]
        assert ticks == sorted(ticks)
        assert all(entry.live and entry.key == key for key, entry in shard.entries.items())
        keys += shard.entries
    return keys


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get", "exist", "delete"]), st.sampled_from("abcdefg"))))
def test_eviction_follows_exact_recency_whatever_the_operations(operations: list[tuple[str, str]]) -> None:
    """Against a model: the least recently put or read object is the one evicted."""
    tier = MemoryTier(4 * SLOT, shards=3)
    model: list[str] = []  # keys, least recently used first
    for op, key in operations:
        if op == "put":
            store(tier, key, key.encode() * 4096)
            if len(model) == 4:  # four fit: the new copy's room is made first, from the oldest
                model.pop(0)
            if key in model:
                model.remove(key)
            model.append(key)
        elif op == "get":
            entry = tier.get(key)
            assert (entry is not None) == (key in model)
            if entry is not None:
                assert bytes(entry.view) == key.encode() * 4096
                tier.unpin(entry)
                model.remove(key)
                model.append(key)
        elif op == "exist":
            assert tier.contains(key) == (key in model)  # no change of recency
        else:
            assert tier.delete(key) == (key in model)
            if key in model:
                model.remove(key)
        assert sorted(_check_recency_order(tier)) == sorted(model)
        assert tier.objects == len(model)


def test_pinned_objects_are_not_evicted_and_memory_is_freed_on_unpin() -> None:
    tier = MemoryTier(2 * SLOT, shards=2)
    store(tier, "old", b"o" * 4096)
    store(tier, "new", b"n" * 4096)
    pinned = tier.get("old")  # a reader still sending it
    assert pinned is not None
    store(tier, "newer", b"z" * 4096)  # must evict "new", the LRU object nobody uses
    assert tier.contains("old") and not tier.contains("new")
    also_pinned = tier.get("newer")
    assert also_pinned is not None
    assert tier.reserve(4096) is None  # everything left is pinned
    assert tier.counters.refusals == 1
    tier.unpin(also_pinned)
    tier.delete("old")  # unlinked while pinned: its buffer is still held ...
    assert tier.pool.in_use == 2 * 4096 and not tier.contains("old")
    assert bytes(pinned.view) == b"o" * 4096  # ... and unchanged for its reader
    tier.unpin(pinned)
    assert tier.pool.in_use == 4096  # returned when the last pin went
    assert tier.reserve(4096) is not None


def test_read_copies_small_objects_unpinned_and_pins_larger_ones() -> None:
    tier = MemoryTier(3 * 4096, shards=2)
    store(tier, "small", b"s" * 100)
    store(tier, "large", b"l" * 4096)
    out = ReplyBuffer()

    def header(key: str, length: int) -> bytes:  # a reply header, as add_framed reads one
        return struct.pack("<ii", 200, length) + key.encode()

    # The Reader a connection hands in (compiled, a Reader cannot be subclassed here), with
    # a header of the test's own.
    copier = ReplyCopier(out.add_framed)
    copier.header_of = lambda entry: header(entry.key, entry.length)

    def read(key: str, copy_up_to: int) -> Entry | None:
        return tier.read(key, copy_up_to, copier)

    entry = read("small", 1000)
    assert entry is not None and entry.pins == 0 and out.take() == header("small", 100) + b"s" * 100
    tier.delete("small")  # nothing pinned it: its buffer goes back at once
    assert tier.pool.in_use == 4096
    entry = read("large", 1000)
    assert entry is not None and entry.pins == 1 and not len(out)  # pinned as by get(), not copied
    assert bytes(entry.view) == b"l" * 4096
    tier.unpin(entry)
    store(tier, "empty", b"")
    entry = read("empty", 1000)
    assert entry is not None and out.take() == header("empty", 0)  # a hit with no bytes: the header alone
    assert read("absent", 1000) is None and not len(out)
    entry = read("large", 4096)  # the limit is inclusive
    assert entry is not None and entry.pins == 0 and out.take() == header("large", 4096) + b"l" * 4096
    assert (tier.counters.hits, tier.counters.misses) == (4, 1)


def test_overwrite_and_abort_account_exactly() -> None:
    tier = MemoryTier(MiB)
    store(tier, "k", b"1" * 1000)
    store(tier, "k", b"22")
    assert (tier.objects, tier.bytes) == (1, 2)
    entry = tier.reserve(5000)
    assert entry is not None
    tier.abort(entry)
    assert tier.pool.in_use == 4096  # only the stored object's buffer
    assert list(tier.keys()) == ["k"]


def test_keys_by_prefix_are_sorted() -> None:
    tier = MemoryTier(MiB)
    for key in ["b/2", "a", "b/1", "c", "b/10"]:
        store(tier, key, b"v")
    assert list(tier.keys()) == ["a", "b/1", "b/10", "b/2", "c"]
    assert list(tier.keys("b/")) == ["b/1", "b/10", "b/2"]


def test_concurrent_threads_keep_the_accounting_exact() -> None:
    tier = MemoryTier(64 * 4096, shards=8)

    def worker(n: int) -> None:
        for i in range(300):
            key = f"t{n}-{i % 40}"
            store(tier, key, bytes([n]) * 3000)
            hit = tier.get(f"t{n}-{(i * 7) % 40}")
            if hit is not None:
                assert bytes(hit.view) == bytes([n]) * 3000
                tier.unpin(hit)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tier.pool.in_use == tier.objects * 4096 <= tier.capacity
    assert tier.bytes == tier.objects * 3000


def test_populate_changes_no_byte_inside_or_outside_the_range() -> None:
    """populate (MADV_POPULATE_WRITE) only faults pages in: a PUT's body may already sit
    just below the range, whatever its alignment, and nothing in or around it changes."""
    import mmap

    from lmserver.storage.pool import POPULATE_MIN, populate

    page = mmap.PAGESIZE
    n = POPULATE_MIN // page + 4
    buf = mmap.mmap(-1, n * page)
    buf[:] = b"\xab" * len(buf)
    start, end = page + 100, (n - 2) * page + 7  # unaligned at both ends; POPULATE_MIN inside
    populate(buf, start, end)
    assert buf[:] == b"\xab" * len(buf)
    buf[2 * page : (n - 2) * page] = b"\x01" * ((n - 4) * page)  # still writable
    assert buf[2 * page : (n - 2) * page] == b"\x01" * ((n - 4) * page)
    populate(buf, 0, 0)  # empty, small and out-of-range requests are no-ops
    populate(buf, 2 * page, 3 * page)  # under POPULATE_MIN: left to fault, content kept
    populate(buf, (n - 1) * page, 100 * n * page)
    assert buf[2 * page : 3 * page] == b"\x01" * page
    assert buf[:page] == b"\xab" * page


def _process_mappings() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts mappings in /proc")
def test_buffers_share_slabs_and_dropping_scattered_ones_splits_no_mapping() -> None:
    """Buffers are slots of a few large mappings (Linux allows ~65,000 mappings a process):
    40,000 small buffers, then every other one dropped, add a handful, not thousands."""
    count = 40_000
    pool = BufferPool(count * 4 * KiB)
    before = _process_mappings()
    held = [pool.acquire(4 * KiB) for _ in range(count)]
    assert all(b is not None for b in held) and len({id(b) for b in held}) == count
    for b in held:
        b[:1] = b"x"  # type: ignore[index]  # touched: its page is resident
    # Slabs double from FIRST_SLAB_BYTES up to SLAB_BYTES, then one per SLAB_BYTES.
    slabs = pool.mappings
    assert slabs <= (SLAB_BYTES // FIRST_SLAB_BYTES).bit_length() + count * 4 * KiB // SLAB_BYTES + 1
    assert _process_mappings() - before < 50
    for b in held[::2]:
        pool.release(b)  # type: ignore[arg-type]
    pool.trim_unused()
    assert pool.trim_unused() == count // 2 * 4 * KiB  # each dropped: pages given back
    assert pool.mappings == slabs and _process_mappings() - before < 50
    for b in held[1::2]:
        pool.release(b)  # type: ignore[arg-type]
    pool.trim_unused()
    pool.trim_unused()
    assert pool.mappings == 0 and pool.idle == 0 and pool.in_use == 0


def test_a_dropped_buffer_comes_back_fresh() -> None:
    """A partially charged buffer is dropped on release: its pages are given back, and the
    slot handed out again reads as zeros (nobody's old body)."""
    pool = BufferPool(MiB)
    keep = pool.acquire(64 * KiB)  # another buffer of the slab: it stays mapped
    got = pool.acquire_partial(64 * KiB, 4 * KiB)
    assert keep is not None and got is not None and got[1] == 4 * KiB
    buf = got[0]
    buf[: 4 * KiB] = b"\xab" * (4 * KiB)
    pool.release(buf, charged=4 * KiB)
    assert pool.in_use == 64 * KiB and pool.idle == 0 and pool.mappings == 1
    again = pool.acquire(64 * KiB)
    assert again is not None and bytes(again) == bytes(64 * KiB)
    pool.release(keep)
    pool.release(again)
    pool.trim_unused()
    pool.trim_unused()
    assert pool.mappings == 0


def test_a_failed_mapping_is_a_full_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the OS has no mapping to give (out of memory, or of mappings), acquire answers
    as a full pool (the memory tier evicts or refuses), counts it, and drops idle buffers."""
    from lmserver.storage import pool as pool_module

    pool = BufferPool(4 * MiB)
    idle = pool.acquire(MiB)
    assert idle is not None
    pool.release(idle)

    def no_mapping(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(pool_module.mmap, "mmap", no_mapping)
    assert pool.acquire(64 * KiB) is None
    assert pool.map_failures == 1 and pool.idle == 0 and pool.in_use == 0
    monkeypatch.undo()
    assert pool.acquire(64 * KiB) is not None


def test_slabs_grow_with_their_class() -> None:
    """A size class in little use maps little: its first slab is FIRST_SLAB_BYTES, and each
    next one doubles what the class has mapped, up to SLAB_BYTES."""
    pool = BufferPool(256 * MiB)
    one = pool.acquire(4 * KiB)
    assert one is not None and pool.mappings == 1 and pool.mapped_bytes == FIRST_SLAB_BYTES
    big = [pool.acquire(8 * MiB) for _ in range(12)]  # 8 MiB class: slabs of 1, 1, 2, 4, 8 slots
    assert all(b is not None for b in big)
    assert pool.mappings == 1 + 5 and pool.mapped_bytes == FIRST_SLAB_BYTES + 16 * 8 * MiB
    huge = pool.acquire(SLAB_BYTES + 1)  # a class past SLAB_BYTES: a slab of one slot each
    assert huge is not None and pool.mappings == 7


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads VmFlags in /proc")
def test_slabs_refuse_transparent_huge_pages_and_stay_one_mapping() -> None:
    """On a host whose transparent huge pages are "always", a huge page could span slots (a
    4 KiB object faulting in 2 MiB): slabs are advised MADV_NOHUGEPAGE, and a populated
    range (a mapping of its own for a moment) gets the advice too and merges back."""
    from lmserver.storage.pool import POPULATE_MIN

    pool = BufferPool(64 * MiB)
    small = pool.acquire(4 * KiB)
    got = pool.acquire_partial(4 * MiB, 4 * KiB)
    assert small is not None and got is not None
    large = got[0]
    assert pool.charge(2 * POPULATE_MIN)
    populate(large, 4 * KiB, 4 * KiB + 2 * POPULATE_MIN)

    def mapping_of(buf: memoryview) -> tuple[int, int, int, list[str]]:
        """The buffer's address, and the start, end and flags of the mapping holding it."""
        address = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        with open("/proc/self/smaps") as smaps:
            inside: tuple[int, int] | None = None
            for line in smaps:
                head = line.split(maxsplit=1)[0]
                if "-" in head and not head.endswith(":"):
                    low, high = (int(x, 16) for x in head.split("-"))
                    inside = (low, high) if low <= address < high else None
                elif inside and head == "VmFlags:":
                    return address, inside[0], inside[1], line.split()[1:]
        raise AssertionError("no mapping holds the buffer")

    assert "nh" in mapping_of(small)[3]
    address, low, high, flags = mapping_of(large)
    assert "nh" in flags
    assert low <= address and address + len(large) <= high  # populating split nothing off
