"""The Store: the one facade a connection talks to, over memory and the chain of tiers
behind it (memory -> disk -> remote tiers, in the operator's order).

Strategy:

* **PUT** lands in memory (the connection receives the body straight into a reserved
  entry). Copies go down the chain behind it: each ``write-behind`` tier gets the object
  if its queue has room (``chain.Link.admit``). When it has none, the tier's ``full``
  policy decides (like the page cache's dirty throttling, or CacheLib's admission control):
  ``wait``: the connection asks ``room_for`` before it reads a PUT body and waits (up to
  ``memory_wait``) until the tier catches up, so nothing is skipped; ``skip``: the write is
  skipped and counted, with its reason. A tier that does not get the new version drops its
  older copy (a *discard* job), so no tier can ever serve a superseded object. PUT_ACK
  waits for the first tier's write ("stored in the first durable tier"), and the
  connection holds just that reply, not the pipeline.
* **Clean before dirty.** An object a tier behind memory holds is *clean* (``Entry.clean``):
  memory evicts clean objects first (they cost nothing to drop) and an object no tier holds
  yet last, and then by demotion.
* **Demotion**: a tier that evicts an object hands it off (``Tier.hand_off``); the Store
  writes it to the next tier unless that tier already holds it, a newer version is in
  flight, or the next tier's queue is full (then it is dropped and counted). Eviction
  never waits: the write is a queued job; the victim (a pinned memory entry, or a file
  moved aside) stays readable by GETs until the job is done.
* **GET** serves memory hits synchronously. Otherwise it reads from the first place that
  holds the key (a victim in flight, then the tiers in order) straight into a memory
  reservation, and promotes it, unless a newer PUT or a DELETE happened meanwhile.
* **EXIST, EXIST_MANY, LIST** answer from in-memory indexes of every tier; never I/O. A GET
  also asks a tier whose ``may_hold`` says so (a shared tier probing its backend for keys
  another server wrote since its last refresh).
* **DELETE** drops the memory copy at once and queues a delete on every tier that holds
  (or is about to hold) the key, behind that key's earlier jobs; it answers when they ran.
* Budgets: memory pinned by objects waiting for tier writes (*dirty*) is at most
  ``dirty_limit`` (``--dirty-limit``, half the memory limit by default), so a slow tier can
  never starve PUTs and promotions of memory; each tier's queue is at most its ``queue``
  bytes; evicted objects waiting for demotion live in an eighth set aside for them
  (``BufferPool.lend``), so eviction frees room at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from lmproto import ObjectMeta

from ..logs import ThrottledWarnings
from .chain import Link
from .memory import Entry, MemoryTier, MemoryVictim, Reader
from .tiers.base import NoSpace, Tier, TierError, Victim
from .tiers.spec import ChainOptions
from .tiers.threaded import Workers

log = structlog.get_logger("lmserver.storage.store")
throttled = ThrottledWarnings(log)

DIRTY_SHARE = 2
"""By default objects waiting for tier writes may pin at most 1/DIRTY_SHARE of memory: the
rest stays free for PUT bodies being received and for promotions from the tiers."""
FLUSH_CONCURRENCY = 4
"""Writes in flight while memory is flushed to the first tier at shutdown."""
_SKIP_COUNTERS = {
    "queue": "skipped_queue_full",
    "dirty": "skipped_dirty_full",
    "wait_timeout": "skipped_wait_timeout",
}
_SKIP_REASONS = {
    "queue": "the tier's queue is full",
    "dirty": "--dirty-limit reached",
    "wait_timeout": "waited --memory-wait for room in vain",
}
LENT_SHARE = 8
"""With tiers behind memory, 1/LENT_SHARE of it holds evicted objects until they are demoted."""


class Store:
    def __init__(
        self,
        memory: MemoryTier,
        tiers: Iterable[tuple[Tier, ChainOptions]] = (),
        *,
        memory_wait: float = 5.0,
        dirty_limit: int | None = None,
    ) -> None:
        self.memory = memory
        self.links = [Link(tier, options, i) for i, (tier, options) in enumerate(tiers, 1)]
        self.memory_wait = memory_wait  # how long a reservation may wait for pinned memory
        self.dirty_limit = memory.capacity // DIRTY_SHARE if dirty_limit is None else dirty_limit
        self.dirty_bytes = 0  # memory pinned by queued tier writes
        self._waiting_links = [link for link in self.links if link.waits_when_full]
        self._victims: dict[str, Victim] = {}  # evicted objects held while being demoted
        self._delete_epoch = 0
        self._space_waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._io: Workers | None = None  # reads and releases of victims from lower tiers
        self.counters = {"lower_hits_dropped": 0}
        _name_uniquely(self.links)

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self.memory.on_space_freed = self._space_freed
        for link in self.links:
            await link.tier.open()
        if self.links:
            self._io = Workers(2, "victims")
            self.memory.clean_first = True
            self.memory.drop_dirty = self.links[0].full == "skip"
            self.memory.on_evict = self._memory_evicted
            self.memory.pool.set_lend_limit(self.memory.capacity // LENT_SHARE)
            for link, following in zip(self.links, self.links[1:], strict=False):
                link.tier.on_evict = self._evicted_hook(following)

    async def close(self, flush_s: float = 0.0) -> None:
        """Finish queued writes, write what only memory holds to the first tier (for up to
        ``flush_s`` seconds), then close every tier."""
        self.memory.on_evict = None
        for link in self.links:
            link.tier.on_evict = None
        for link in self.links:
            await link.drain()
        if self.links and flush_s > 0:
            await self._flush_memory(self.links[0], time.monotonic() + flush_s)
        for link in self.links:
            await link.tier.close()
        if self._io is not None:
            self._io.shutdown()
        self.memory.on_space_freed = None

    # -- PUT ----------------------------------------------------------------------------

    def reserve(self, length: int, upfront: int | None = None) -> Entry | None:
        return self.memory.reserve(length, upfront)

    async def reserve_wait(self, length: int, max_wait: float, upfront: int | None = None) -> Entry | None:
        """Reserve, waiting up to ``max_wait`` seconds for pinned memory to be released."""
        deadline = time.monotonic() + max_wait
        while True:
            entry = self.memory.reserve(length, upfront)
            if entry is not None:
                return entry
            if not await self._wait_for_space(deadline):
                return None

    def grow(self, entry: Entry, charged: int) -> bool:
        """Charge a reservation up to ``charged`` bytes now (``MemoryTier.grow``)."""
        return self.memory.grow(entry, charged)

    async def grow_wait(self, entry: Entry, charged: int, max_wait: float) -> bool:
        """``MemoryTier.grow``, waiting up to ``max_wait`` seconds for pinned memory."""
        deadline = time.monotonic() + max_wait
        while not self.memory.grow(entry, charged):
            if not await self._wait_for_space(deadline):
                return False
        return True

    async def _wait_for_space(self, deadline: float) -> bool:
        """Wait until memory is released (or a short poll passes); False past ``deadline``."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        waiter = asyncio.get_running_loop().create_future()
        self._space_waiters.append(waiter)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter, min(remaining, 0.05))
        return True

    def room_for(self, length: int) -> bool:
        """Whether a PUT of ``length`` bytes finds room in every ``full=wait`` tier's queue
        (and in the dirty share); the connection asks before it reads the body."""
        if not self._waiting_links:
            return True
        waits = [link for link in self._waiting_links if self._may_wait(link, length)]
        return not waits or (
            self.dirty_bytes + length <= self.dirty_limit and all(link.has_room(length) for link in waits)
        )

    def _may_wait(self, link: Link, length: int) -> bool:
        """A ``full=wait`` tier, and an object that could ever fit its queue and the dirty
        share (a larger one is skipped at once: waiting could not help)."""
        return link.waits_when_full and length <= link.queue_limit and length <= self.dirty_limit

    async def wait_for_room(self, length: int, max_wait: float) -> bool:
        """Wait up to ``max_wait`` seconds for ``room_for(length)``; False if it never came."""
        for link in self._waiting_links:
            if self._may_wait(link, length):
                link.counters["full_waits"] += 1
        deadline = time.monotonic() + max_wait
        while not self.room_for(length):
            if not await self._wait_for_space(deadline):
                return False
        return True

    def commit(
        self, key: str, entry: Entry, meta: ObjectMeta, *, acknowledged: bool = False, room: bool = True
    ) -> asyncio.Future[bool] | None:
        """Publish a received object and queue its copies down the chain. ``room``: what the
        connection's ``room_for``/``wait_for_room`` found before the body (``full=wait``
        tiers take the object then, even if a concurrent PUT filled them meanwhile). Returns,
        for an acknowledged PUT with tiers behind memory, a future resolving to True once the
        first tier holds it; else None."""
        if not self.links:
            self.memory.commit(key, entry, meta)
            return None
        self.memory.pin(entry)  # held across the commit; dropped below or by the writes
        self.memory.commit(key, entry, meta)
        ack: asyncio.Future[bool] | None = None
        for link in self.links:
            must = acknowledged and ack is None
            if must or link.write_behind:
                waits = self._may_wait(link, entry.length)
                bound = self._admit(link, entry.length, force=must or (room and waits))
                if bound is None:
                    self.memory.pin(entry)
                    done = link.enqueue(key, functools.partial(self._write, link, key, entry, meta, must))
                    if must:
                        ack = done
                    continue
                self._skipped(link, "wait_timeout" if waits else bound)
            if link.busy(key) or link.tier.contains(key):
                link.counters["discards"] += 1
                link.enqueue(key, functools.partial(link.tier.delete, key))
        self.memory.unpin(entry)
        return ack

    def _admit(self, link: Link, length: int, *, force: bool) -> str | None:
        """Book a write of ``length`` bytes for ``link``: None if admitted, else the bound
        that was full (``"dirty"``: the memory share; ``"queue"``: the tier's queue)."""
        if not force and self.dirty_bytes + length > self.dirty_limit:
            return "dirty"
        if not link.admit(length, force=force):
            return "queue"
        self.dirty_bytes += length
        return None

    def _skipped(self, link: Link, reason: str) -> None:
        link.counters["skipped_writes"] += 1
        link.counters[_SKIP_COUNTERS[reason]] += 1
        throttled.warning(
            "tier write skipped",
            per=f"{link.name}/{reason}",
            tier=link.name,
            reason=_SKIP_REASONS[reason],
            full=link.full,
            queue_limit=link.queue_limit,
            dirty_limit=self.dirty_limit,
        )

    async def _write(self, link: Link, key: str, entry: Entry, meta: ObjectMeta, acknowledged: bool) -> bool:
        try:
            if not entry.live and not acknowledged:
                return False  # superseded or deleted: the job queued after this one wins
            ok = await link.tier.put(key, entry.view, meta)
            link.counters["writes" if ok else "write_failures"] += 1
            if ok:
                self.memory.mark_clean(entry)
            return ok
        finally:
            link.done_with(entry.length)
            self.dirty_bytes -= entry.length
            self.memory.unpin(entry)
            self._wake_space_waiters()

    async def _flush_memory(self, link: Link, deadline: float) -> None:
        """At shutdown, copy to the first tier what it does not hold (writes that were
        skipped, objects of a demote-only tier), most recently used first, so a restart
        finds them. Bounded by ``deadline``; what is left is counted in the log line."""
        entries = self.memory.pinned_by_recency()
        started, written, left = time.monotonic(), 0, 0
        pending: set[asyncio.Task[bool]] = set()
        try:
            for entry in entries:
                if not entry.live or entry.clean or link.tier.contains(entry.key):
                    continue
                if time.monotonic() >= deadline:
                    left += 1
                    continue
                if len(pending) >= FLUSH_CONCURRENCY:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    written += sum(_succeeded(task) for task in done)
                pending.add(asyncio.ensure_future(link.tier.put(entry.key, entry.view, entry.meta)))
            if pending:
                await asyncio.wait(pending)
                written += sum(_succeeded(task) for task in pending)
        finally:
            for entry in entries:
                self.memory.unpin(entry)
        if written or left:
            log.info(
                "memory flushed to the first tier",
                tier=link.name,
                objects=written,
                not_written=left,
                seconds=round(time.monotonic() - started, 3),
            )

    def abort(self, entry: Entry) -> None:
        self.memory.abort(entry)

    def _space_freed(self) -> None:
        # May run on a worker thread (a tier finishing with a buffer).
        if self._space_waiters and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake_space_waiters)

    def _wake_space_waiters(self) -> None:
        waiters, self._space_waiters = self._space_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- demotion -------------------------------------------------------------------------

    def _memory_evicted(self, victim: MemoryVictim) -> None:
        """Memory evicted ``victim`` (synchronously, inside a reservation): take it for the
        first tier or let it go at once, so the reservation can use its buffer."""
        if threading.get_ident() != self._loop_thread:
            victim.release()  # not on the loop: cannot queue safely; memory must free now
            return
        self._offer(self.links[0], victim, from_memory=True)

    def _evicted_hook(self, following: Link) -> Callable[[Victim], None]:
        def evicted(victim: Victim) -> None:
            # Called from the evicting tier's worker thread.
            loop = self._loop
            if loop is None or loop.is_closed():
                victim.release()
                return
            try:
                loop.call_soon_threadsafe(self._offer, following, victim, False)
            except RuntimeError:  # loop closed meanwhile
                victim.release()

        return evicted

    def _offer(self, link: Link, victim: Victim, from_memory: bool) -> None:
        key = victim.key
        if any(below.readable(key) for below in self.links[link.position - 1 :]):
            # Already there or further down (every tier holds the current version or
            # nothing): copying it back up would only evict something else.
            self._drop(victim)
            return
        if (
            not from_memory
            and self.memory.contains(key)
            and not any(other.readable(key) for other in self.links)
        ):
            # Memory holds it and the tier behind it just let it go: memory's copy is now
            # the only one, so memory must demote it rather than drop it when it evicts.
            self.memory.mark_dirty(key)
        newer = self.memory.contains(key) or key in self._victims
        if not from_memory:
            newer = newer or any(other.busy(key) for other in self.links)
        # A memory victim's buffer is already in the memory pool's lent share (memory.py).
        if newer or not link.admit(victim.length):
            link.counters["demotions_skipped"] += 1
            self._drop(victim)
            return
        self._victims[key] = victim
        link.enqueue(key, functools.partial(self._demote, link, victim, from_memory))

    async def _demote(self, link: Link, victim: Victim, from_memory: bool) -> bool:
        key = victim.key
        try:
            if self.memory.contains(key):
                link.counters["demotions_skipped"] += 1  # a newer PUT (its own jobs follow)
                return False
            if from_memory:
                data = victim.open()
            else:
                assert self._io is not None
                data = await self._io.run(victim.open)
            ok = await link.tier.put(key, data, victim.meta)
            del data
            link.counters["demotions" if ok else "write_failures"] += 1
            return ok
        finally:
            if self._victims.get(key) is victim:
                del self._victims[key]
            link.done_with(victim.length)
            self._drop(victim)
            self._wake_space_waiters()

    def _drop(self, victim: Victim) -> None:
        if isinstance(victim, MemoryVictim) or self._io is None:
            victim.release()  # an unpin: cheap, and the memory is wanted now
        else:
            with contextlib.suppress(TierError):
                self._io.submit(victim.release)  # file I/O: off the loop

    # -- GET ----------------------------------------------------------------------------

    def read(self, key: str, copy_up_to: int, reader: Reader) -> Entry | None:
        r"""A memory hit as ``MemoryTier.read`` gives it (small objects copied out by
        ``reader``; larger ones pinned: the caller ``release``\ s them once sent), else None."""
        entry = self.memory.read(key, copy_up_to, reader)
        if entry is not None:
            for link in self.links:
                link.tier.touch(key)
        return entry

    def release(self, entry: Entry) -> None:
        """Done with an entry ``read``, ``fetch`` or ``reserve`` handed out pinned."""
        self.memory.unpin(entry)

    def exist_index(self) -> tuple[dict[str, Entry], ...]:
        """Memory's key -> entry dicts, one per shard (``Store.contains`` for memory, without
        a lock: one atomic dict lookup), for the connection's EXIST path in C
        (``ReplyBuffer.add_exists``). A key they lack may be behind memory when ``links``."""
        return self.memory.entry_dicts

    def in_lower(self, key: str) -> bool:
        """Whether a GET that missed memory should look behind it (a shared tier that
        probes its backend says yes for keys it has not indexed)."""
        return key in self._victims or any(link.fetchable(key) for link in self.links)

    async def fetch(self, key: str) -> Entry | None:
        """Read ``key`` from behind memory into a pinned memory entry (promoting it)."""
        epoch = self._delete_epoch
        victim = self._victims.get(key)
        if isinstance(victim, MemoryVictim):
            # Still in memory, pinned by its demotion: serve that buffer as it is.
            entry = victim.entry
            if entry is not None:
                self.memory.pin(entry)
                return entry
        elif victim is not None:
            entry = await self._fetch_victim(victim)
            if entry is not None:
                return self._promote(key, entry, victim.meta, epoch)
        for link in self.links:
            if not link.fetchable(key):
                continue
            reserved: list[Entry] = []

            def alloc(length: int, reserved: list[Entry] = reserved) -> memoryview:
                entry = self.memory.reserve(length)
                if entry is None:
                    raise NoSpace(f"no memory for a {length}-byte object read from a lower tier")
                reserved.append(entry)
                return memoryview(entry.buffer)[:length]

            meta = await self._read_waiting_for_memory(link.tier, key, alloc)
            if meta is None:
                for entry in reserved:
                    self.memory.abort(entry)
                continue
            for extra in reserved[:-1]:  # a retried read: only the last buffer holds it
                self.memory.abort(extra)
            link.counters["promotions"] += 1
            return self._promote(key, reserved[-1], meta, epoch)
        return None

    async def _fetch_victim(self, victim: Victim) -> Entry | None:
        entry = self.memory.reserve(victim.length)
        if entry is None:
            return None
        assert self._io is not None
        try:
            await self._io.run(_copy_from, victim, memoryview(entry.buffer)[: victim.length])
        except TierError:
            self.memory.abort(entry)
            return None
        return entry

    def _promote(self, key: str, entry: Entry, meta: ObjectMeta, epoch: int) -> Entry | None:
        """Publish a pinned reservation read from behind memory, unless a DELETE or a newer
        PUT happened meanwhile; returns what the GET should send (pinned)."""
        if epoch == self._delete_epoch and not self.memory.contains(key):
            self.memory.pin(entry)  # the reader's pin survives the commit
            if self.memory.commit_if_absent(key, entry, meta):
                self.memory.mark_clean(entry)  # the tier it came from holds it
                return entry
            self.memory.abort(entry)
            return self.memory.get(key)
        # Not promoted: hand out the private entry; the caller's unpin frees it.
        entry.meta = meta
        return entry

    async def _read_waiting_for_memory(
        self, tier: Tier, key: str, alloc: Callable[[int], memoryview]
    ) -> ObjectMeta | None:
        """A lower-tier read into memory; while memory is full of pinned objects (sends and
        writes in flight), wait for some to finish, up to ``memory_wait`` seconds."""
        deadline = time.monotonic() + self.memory_wait
        while True:
            try:
                return await tier.get_into(key, alloc)
            except NoSpace:
                if not await self._wait_for_space(deadline):
                    self.counters["lower_hits_dropped"] += 1
                    throttled.warning(
                        "lower-tier hit not served: memory stayed full of objects in use", tier=tier.name
                    )
                    return None

    # -- EXIST, DELETE, LIST --------------------------------------------------------------

    def contains(self, key: str) -> bool:
        """EXIST: from the indexes only (never I/O, never a backend probe)."""
        if self.memory.contains(key):
            return True
        return key in self._victims or any(link.readable(key) for link in self.links)

    async def delete(self, key: str) -> bool:
        self._delete_epoch += 1
        found = self.memory.delete(key) or key in self._victims
        deletes = []
        for link in self.links:
            if link.busy(key) or link.tier.contains(key):
                deletes.append(link.enqueue(key, functools.partial(link.tier.delete, key)))
        if deletes:
            found = any(await asyncio.gather(*deletes)) or found
        return found

    def keys(self, prefix: str = "", limit: int | None = None) -> list[str]:
        """Sorted, de-duplicated keys of every tier starting with ``prefix``."""
        sources: list[Iterable[str]] = [self.memory.keys(prefix)]
        sources.append(sorted(k for k in list(self._victims) if k.startswith(prefix)))
        sources += [link.tier.keys(prefix) for link in self.links]
        return list(itertools.islice(_unique(heapq.merge(*sources)), limit))

    # -- reporting ------------------------------------------------------------------------

    def size_in_memory(self, key: str) -> int | None:
        """The length of ``key``'s object if memory holds it (no I/O, no recency change)."""
        return self.memory.length_of(key)

    def trim_idle_memory(self) -> int:
        """Give the OS back object buffers that stayed idle since the last call; the bytes."""
        return self.memory.pool.trim_unused()

    def memory_usage(self) -> dict[str, int]:
        return self.memory.usage()

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {"memory": self.memory.usage()}
        for link in self.links:
            tiers[link.name] = link.stats()
        return {
            "tiers": tiers,
            "chain": {
                "dirty_bytes": self.dirty_bytes,
                "dirty_limit": self.dirty_limit,
                "victims_in_flight": len(self._victims),
            },
            **self.counters,
        }

    def activity(self) -> dict[str, int]:
        """Counters worth a line in the periodic activity log, flat, per tier."""
        watched = ("skipped_writes", "full_waits", "demotions", "demotions_skipped", "write_failures")
        return {f"{link.name}_{name}": link.counters[name] for link in self.links for name in watched}


def _succeeded(task: asyncio.Task[bool]) -> bool:
    return not task.cancelled() and task.exception() is None and task.result()


def _copy_from(victim: Victim, target: memoryview) -> None:
    source = victim.open()
    try:
        target[:] = source
    finally:
        source.release()


def _name_uniquely(links: list[Link]) -> None:
    seen: dict[str, int] = {}
    for link in links:
        base = link.tier.name
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            link.tier.name = f"{base}{seen[base]}"


def _unique(keys: Iterator[str]) -> Iterator[str]:
    last = None
    for key in keys:
        if key != last:
            yield key
            last = key
