"""The memory tier: sharded LRU maps over pooled buffers, with byte-exact capacity.

Strategy:

* Every object lives in an ``Entry`` whose buffer comes from a `BufferPool` sized to the
  memory limit, so the limit covers objects, bodies still arriving (reservations) and
  evicted objects that are still being sent or written elsewhere.
* An entry is *pinned* while anyone reads its buffer outside the tier (a GET reply still
  in the socket's send queue, a write-behind to disk). Removing a pinned entry unlinks it
  at once but returns its buffer to the pool only when the last pin goes, so a buffer is
  never rewritten under a reader.
* Keys are spread over N shards, each a lock and an insertion-ordered dict kept in
  recency order. Every access stamps the entry with a global tick, so the global LRU
  victim is the shard head with the smallest tick: exact LRU with short, sharded locks.
* Recency: GET (hit) and PUT refresh an object; EXIST, EXIST_MANY, LIST and STATS do not,
  so a lookup storm never reorders what is cached.
* Clean before dirty (with tiers behind memory: ``clean_first``): an object a tier behind
  holds is *clean* (the Store marks it once written there, or when promoted from there);
  eviction takes the least recently used clean object, and an object no tier holds yet
  only when no clean one is found among each shard's ``CLEAN_SCAN`` least recently used,
  and then by demotion. Each shard counts its clean objects, so a shard with none is not
  searched.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Final

from sortedcontainers import SortedSet

from lmproto import NO_META, ObjectMeta

from .._shard import ShardLock, shard_index
from .pool import Buffer, BufferPool, populate, size_class
from .tiers.base import Victim


class Entry:
    """One object (or one reservation, before ``commit``) and its buffer."""

    __slots__ = (
        "buffer",
        "charged",
        "clean",
        "key",
        "length",
        "lent",
        "live",
        "meta",
        "pins",
        "reader_cache",
        "reader_tag",
        "tick",
    )

    def __init__(self, buffer: Buffer, length: int, charged: int) -> None:
        self.buffer = buffer
        self.length = length
        self.charged = charged  # bytes of the buffer counted against capacity
        self.key = ""
        self.meta: ObjectMeta = NO_META
        self.pins = 1  # the creator's pin: a reservation is pinned by its writer
        self.live = False  # reachable through the index
        self.lent = False  # evicted and being demoted: its buffer is in the pool's lent share
        self.clean = False  # a tier behind memory holds this version (see MemoryTier)
        self.tick = 0
        # Bytes a ``Reader`` derived from what never changes once the object is stored (its
        # length and metadata), kept here for it under its tag; the tier never reads them.
        self.reader_cache = b""
        self.reader_tag: object = None

    @property
    def view(self) -> memoryview:
        """The object's bytes (a view; no copy)."""
        return memoryview(self.buffer)[: self.length]


class Reader:
    """What copies a small object out of the tier while its shard lock is held (so its buffer
    cannot be reused meanwhile): a connection's replies subclass it, once per connection, and
    frame the copy as they need to; the tier knows nothing of the framing. A native class
    (compiled), so ``read``'s call of ``copy`` is a direct one."""

    def copy(self, entry: Entry) -> None:
        """Copy ``entry``'s bytes out (they are ``entry.buffer[:entry.length]``)."""


_NOTHING_COPIED: Final = Reader()
"""``get`` copies nothing (it reads with ``copy_up_to`` -1)."""


class MemoryVictim(Victim):
    """An evicted entry kept pinned while the Store demotes it to the first tier: its
    buffer is not reused (nor counted free) until ``release``.

    No ``__slots__``: compiled (mypyc), a subclass of a Python class cannot have them."""

    def __init__(self, memory: MemoryTier, entry: Entry) -> None:
        super().__init__(entry.key, entry.length, entry.meta)
        self.memory = memory
        self.entry: Entry | None = entry

    def open(self) -> memoryview:
        assert self.entry is not None, "victim used after release"
        return self.entry.view

    def release(self) -> None:
        entry, self.entry = self.entry, None
        if entry is not None:
            self.memory.unpin(entry)


@dataclass
class MemoryCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    refusals: int = 0
    demotions_dropped: int = 0  # evicted while the share for objects being demoted was full
    demotions_waited: int = 0  # evictions refused instead (the first tier is full=wait)


# Compiled (mypyc), a name imported from a module that is not compiled is looked up in this
# module's dict on every call unless it is Final (a C static).
_shard_index: Final = shard_index


class _Shard:
    __slots__ = ("acquire", "clean", "entries", "lock", "release")

    def __init__(self) -> None:
        self.lock = ShardLock()
        # The lock's methods, bound once for the GET path: compiled, lock.acquire() looks
        # the method up by name on every call.
        self.acquire: Callable[[], bool] = self.lock.acquire
        self.release: Callable[[], None] = self.lock.release
        self.entries: dict[str, Entry] = {}
        self.clean = 0  # entries marked clean


CLEAN_SCAN = 64
"""How far eviction looks past dirty objects at a shard's cold end for a clean one."""

OBJECT_OVERHEAD = 1024
"""What the tier keeps per object beside its buffer (the key, its places in a shard's dict
and in the sorted key set, the Entry), charged against the capacity with the buffer, so the
limit covers the RSS small objects cost too. Measured: 676 bytes with 16-byte keys, 786 with
140-byte keys (``python -m bench.object_overhead``); keys have at most 150 bytes."""


class MemoryTier:
    """Thread-safe; used synchronously from the event loop and from tier worker threads."""

    name = "memory"

    def __init__(self, capacity: int, *, shards: int = 16) -> None:
        self.pool = BufferPool(capacity, object_overhead=OBJECT_OVERHEAD)
        self.counters = MemoryCounters()
        self._shards = [_Shard() for _ in range(shards)]
        # Each shard's key -> entry dict, in shard order: what ``contains`` looks in, for the
        # connection's EXIST path in C (ReplyBuffer.add_exists), which looks without a lock
        # as ``contains`` does. The dicts live as long as their shards.
        self.entry_dicts: tuple[dict[str, Entry], ...] = tuple(shard.entries for shard in self._shards)
        self._tick = 0  # the last tick stamped (_next_tick)
        self._keys: SortedSet = SortedSet()
        self._keys_lock = threading.Lock()
        self._bytes = 0
        self.on_space_freed: Callable[[], None] | None = None
        # Takes evicted objects for demotion (the Store sets it when tiers stand behind).
        self.on_evict: Callable[[MemoryVictim], None] | None = None
        self.clean_first = False  # evict clean objects before dirty ones (tiers behind)
        # Whether a dirty object that cannot be demoted now may be dropped (the first tier
        # behind is full=skip); else eviction stops there and reservations wait for room.
        self.drop_dirty = True

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    def _shard(self, key: str) -> _Shard:
        return self._shards[_shard_index(key, len(self._shards))]

    # -- writing --------------------------------------------------------------------------

    def reserve(self, length: int, upfront: int | None = None) -> Entry | None:
        """A pinned, unpublished entry with room for ``length`` bytes, evicting LRU objects
        as needed; None when even eviction cannot make room (everything left is pinned).

        With ``upfront``, a fresh buffer is charged only that much for now: its writer
        calls ``grow`` before filling more of it (``Entry.charged`` says how far it may)."""
        charge = size_class(length) if upfront is None else upfront
        while True:
            got = self.pool.acquire_partial(length, charge)
            if got is not None:
                return Entry(got[0], length, got[1])
            if not self._evict_one():
                self.counters.refusals += 1
                return None

    def grow(self, entry: Entry, charged: int) -> bool:
        """Charge ``entry`` up to ``charged`` bytes (at most its buffer), evicting LRU objects
        as needed; False when even eviction cannot make room."""
        more = min(charged, len(entry.buffer)) - entry.charged
        while more > 0:
            if self.pool.charge(more):
                populate(entry.buffer, entry.charged, entry.charged + more)  # not written yet
                entry.charged += more
                return True
            if not self._evict_one():
                self.counters.refusals += 1
                return False
        return True

    def commit(self, key: str, entry: Entry, meta: ObjectMeta) -> None:
        """Publish a reserved entry under ``key`` (replacing any old object) and drop the
        writer's pin. The caller may pin it again first if it keeps using the buffer."""
        entry.key = key
        entry.meta = meta
        entry.live = True
        shard = self._shard(key)
        with shard.lock:
            entry.tick = self._next_tick()
            old = shard.entries.pop(key, None)
            shard.entries[key] = entry
            if old is not None:
                old.live = False
                if old.clean:
                    shard.clean -= 1
        with self._keys_lock:
            self._bytes += entry.length
            if old is None:
                self._keys.add(key)
            else:
                self._bytes -= old.length
        if old is not None:
            self._drop_pin_if_dead(old, unpin=False)
        self.unpin(entry)

    def commit_if_absent(self, key: str, entry: Entry, meta: ObjectMeta) -> bool:
        """Like commit, unless ``key`` is already present (a newer PUT won): then the
        reservation is released. Used when promoting from a lower tier."""
        shard = self._shard(key)
        with shard.lock:
            present = key in shard.entries
        if present:
            self.unpin(entry)
            return False
        self.commit(key, entry, meta)
        return True

    def abort(self, entry: Entry) -> None:
        """Give back a reservation that will never be published (PUT cut short)."""
        self.unpin(entry)

    # -- reading ------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """The object under ``key``, pinned and refreshed in the LRU; the caller unpins."""
        return self.read(key, -1, _NOTHING_COPIED)

    def read(self, key: str, copy_up_to: int, reader: Reader) -> Entry | None:
        """``get`` for a reader that copies small objects: an object of at most
        ``copy_up_to`` bytes is copied out by ``reader.copy(entry)`` under the shard lock (a
        GET queues its reply so), and its entry comes back not pinned (read only its
        metadata). A larger one comes back pinned, as by ``get``. None for a miss. One lock
        round trip, where pinning and unpinning a small object took two."""
        shard = self._shards[_shard_index(key, len(self._shards))]  # _shard(), inlined: the GET path
        shard.acquire()  # not `with`: compiled, that is two generic method calls more per GET
        try:
            entry = shard.entries.pop(key, None)
            if entry is None:
                self.counters.misses += 1
                return None
            shard.entries[key] = entry  # re-insert: most recently used goes last
            entry.tick = self._next_tick()
            if entry.length <= copy_up_to:
                reader.copy(entry)
            else:
                entry.pins += 1
        finally:
            shard.release()
        self.counters.hits += 1
        return entry

    def _next_tick(self) -> int:
        # A plain int, not itertools.count: compiled, next() on an iterator is a builtins
        # lookup and a generic call, ~5% of a small GET. Callers hold a shard lock, not one
        # global lock: compiled, the increment runs under the GIL without a break; from
        # source, two threads may at worst stamp one tick twice, a tie between two accesses
        # that were concurrent anyway.
        self._tick += 1
        return self._tick

    def contains(self, key: str) -> bool:
        """Presence without touching recency."""
        return key in self._shards[_shard_index(key, len(self._shards))].entries

    def length_of(self, key: str) -> int | None:
        """The object's length, without touching recency; None if absent."""
        entry = self._shards[_shard_index(key, len(self._shards))].entries.get(key)
        return None if entry is None else entry.length

    def mark_clean(self, entry: Entry) -> None:
        """A tier behind memory now holds this version of the object."""
        shard = self._shard(entry.key)
        with shard.lock:
            if entry.live and not entry.clean:
                entry.clean = True
                shard.clean += 1

    def mark_dirty(self, key: str) -> None:
        """No tier behind memory holds ``key`` any more (the last one evicted it)."""
        shard = self._shard(key)
        with shard.lock:
            entry = shard.entries.get(key)
            if entry is not None and entry.clean:
                entry.clean = False
                shard.clean -= 1

    def pin(self, entry: Entry) -> None:
        with self._shard(entry.key).lock:
            entry.pins += 1

    def unpin(self, entry: Entry) -> None:
        # Once per GET: the common case (still live, or still pinned) decides under the
        # lock and returns; only the last pin of a dead entry goes on to release it.
        with self._shards[_shard_index(entry.key, len(self._shards))].lock:
            entry.pins -= 1
            if entry.pins or entry.live or entry.buffer is None:
                return
        self._drop_pin_if_dead(entry, unpin=False)

    def _drop_pin_if_dead(self, entry: Entry, *, unpin: bool) -> None:
        with self._shard(entry.key).lock:
            if unpin:
                entry.pins -= 1
            release = entry.pins == 0 and not entry.live and entry.buffer is not None
            buf = entry.buffer
            if release:
                entry.buffer = None  # type: ignore[assignment]
        if release:
            self.pool.release(buf, entry.charged, lent=entry.lent)
            if self.on_space_freed is not None:
                self.on_space_freed()

    # -- removing -----------------------------------------------------------------------

    def delete(self, key: str) -> bool:
        shard = self._shard(key)
        with shard.lock:
            entry = shard.entries.pop(key, None)
            if entry is None:
                return False
            entry.live = False
            if entry.clean:
                shard.clean -= 1
        self._unlinked(entry)
        return True

    def _unlinked(self, entry: Entry) -> None:
        """Account for an entry just removed from its shard, and free it unless pinned."""
        with self._keys_lock:
            self._keys.discard(entry.key)
            self._bytes -= entry.length
        self._drop_pin_if_dead(entry, unpin=False)

    def _evict_one(self) -> bool:
        """Unlink the least recently used object that nobody is using, clean ones first
        (``clean_first``); False if none.

        Pinned objects (being sent, or written behind to disk) are passed over: unlinking
        them would free nothing now, and they are in use, i.e. recently used, anyway.
        """
        victim: Entry | None = None
        clean: Entry | None = None
        for shard in self._shards:
            with shard.lock:
                head, cold_clean = self._cold_end(shard)
            if head is not None and (victim is None or head.tick < victim.tick):
                victim = head
            if cold_clean is not None and (clean is None or cold_clean.tick < clean.tick):
                clean = cold_clean
        if clean is not None:
            victim = clean
        if victim is None:
            return False
        # A clean object is dropped: a tier behind holds it. A dirty one is demoted if a
        # taker exists and the lent share has room: its buffer stays (pinned, lent) until
        # written, yet frees room for the reservation at once.
        hook = self.on_evict
        if victim.clean or hook is None:
            return self._evict_entry(victim, None)
        if self.pool.lend(victim.buffer):
            return self._evict_entry(victim, hook, lent=True)
        # It cannot be demoted now: rather a clean object from anywhere than this one.
        deeper = self._any_clean()
        if deeper is not None:
            return self._evict_entry(deeper, None)
        if not self.drop_dirty:
            self.counters.demotions_waited += 1
            return False  # like memory full of pinned objects: the reservation waits
        self.counters.demotions_dropped += 1
        return self._evict_entry(victim, None)

    def _any_clean(self) -> Entry | None:
        """The least recently used unpinned clean entry of any shard (a full search: only
        when the cold ends hold none and the object found there cannot be demoted)."""
        found: Entry | None = None
        for shard in self._shards:
            if not shard.clean:
                continue
            with shard.lock:
                entry = next((e for e in shard.entries.values() if e.clean and e.pins == 0), None)
            if entry is not None and (found is None or entry.tick < found.tick):
                found = entry
        return found

    def _evict_entry(
        self, victim: Entry, hook: Callable[[MemoryVictim], None] | None, *, lent: bool = False
    ) -> bool:
        """Unlink ``victim`` (handing it to ``hook`` for demotion, its buffer ``lent``)."""
        shard = self._shard(victim.key)
        with shard.lock:
            if victim.pins or shard.entries.get(victim.key) is not victim:
                if lent:
                    self.pool.unlend(victim.buffer)
                return True  # used or replaced meanwhile: look again
            if hook is not None:
                victim.lent = True
                victim.pins += 1  # the demotion's pin, handed to the hook
            del shard.entries[victim.key]
            victim.live = False
            if victim.clean:
                shard.clean -= 1
        self._unlinked(victim)
        self.counters.evictions += 1
        self.counters.evicted_bytes += victim.length
        if hook is not None:
            hook(MemoryVictim(self, victim))
        return True

    def _cold_end(self, shard: _Shard) -> tuple[Entry | None, Entry | None]:
        """A shard's least recently used unpinned entry, and its least recently used unpinned
        clean one within ``CLEAN_SCAN`` dirty entries of the cold end (under its lock)."""
        head: Entry | None = None
        if not (self.clean_first and shard.clean):
            for entry in shard.entries.values():
                if entry.pins == 0:
                    return entry, None
            return None, None
        dirty_seen = 0
        for entry in shard.entries.values():
            if entry.pins:
                continue
            if entry.clean:
                return (entry if head is None else head), entry
            if head is None:
                head = entry
            dirty_seen += 1
            if dirty_seen >= CLEAN_SCAN:
                break
        return head, None

    # -- listing and accounting ---------------------------------------------------------

    def pinned_by_recency(self) -> list[Entry]:
        """Every object, pinned (the caller unpins each), most recently used first."""
        entries: list[Entry] = []
        for shard in self._shards:
            with shard.lock:
                for entry in shard.entries.values():
                    entry.pins += 1
                    entries.append(entry)
        entries.sort(key=lambda e: e.tick, reverse=True)
        return entries

    def keys(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with ``prefix`` in sorted order (a snapshot)."""
        with self._keys_lock:
            if not prefix:
                return iter(list(self._keys))
            matching = itertools.takewhile(lambda k: k.startswith(prefix), self._keys.irange(minimum=prefix))
            return iter(list(matching))

    @property
    def objects(self) -> int:
        return sum(len(shard.entries) for shard in self._shards)

    @property
    def bytes(self) -> int:
        """Object bytes (lengths); the pool's ``in_use`` counts the buffers behind them."""
        return self._bytes

    def usage(self) -> dict[str, int]:
        c = self.counters
        return {
            "objects": self.objects,
            "bytes": self._bytes,
            "capacity": self.capacity,
            "reserved_bytes": self.pool.in_use,
            "metadata_bytes": self.pool.overhead,
            "idle_pool_bytes": self.pool.idle,
            "demoting_bytes": self.pool.lent,
            "pool_fresh_allocations": self.pool.fresh_allocations,
            "pool_reuses": self.pool.reuses,
            "pool_mappings": self.pool.mappings,
            "pool_mapped_bytes": self.pool.mapped_bytes,
            "pool_map_failures": self.pool.map_failures,
            "hits": c.hits,
            "misses": c.misses,
            "evictions": c.evictions,
            "evicted_bytes": c.evicted_bytes,
            "refusals": c.refusals,
            "demotions_dropped": c.demotions_dropped,
            "demotions_waited": c.demotions_waited,
        }
