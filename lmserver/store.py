"""The Store: the one facade a connection talks to, over the memory tier and the tiers
behind it.

Strategy:

* PUT lands in memory (the connection receives the body straight into a reserved entry).
  With lower tiers the object is also written to the first of them **write-behind**: the
  entry stays pinned until the write finishes, so memory eviction never loses it, and at
  most ``write_behind_limit`` bytes may be waiting (connections hold further PUTs back
  until the backlog drains). PUT_ACK waits for that write, so its answer means "on disk,
  durable per --fsync".
* Writes of one key to the lower tier are chained, so an older version can never land
  after a newer one. DELETE and GET wait for a pending write of their key first.
* GET serves memory hits synchronously. A miss that a lower tier holds is read straight
  into a memory reservation and promoted (unless a newer PUT or a DELETE happened
  meanwhile: then the read is served but not promoted).
* EXIST, EXIST_MANY and LIST answer from in-memory indexes of every tier; they never do I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import structlog

from lmproto import ObjectMeta

from .logs import ThrottledWarnings
from .memory import Entry, MemoryTier
from .tiers.base import NoSpace, Tier

log = structlog.get_logger("lmserver.store")
throttled = ThrottledWarnings(log)


class Store:
    def __init__(
        self,
        memory: MemoryTier,
        lower: Iterable[Tier] = (),
        *,
        write_behind_limit: int,
        memory_wait: float = 5.0,
    ) -> None:
        self.memory = memory
        self.lower: list[Tier] = list(lower)
        self.write_behind_limit = write_behind_limit
        self.memory_wait = memory_wait  # how long a reservation may wait for pinned memory
        self._pending: dict[str, asyncio.Future[bool]] = {}
        self._pending_bytes = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._delete_epoch = 0
        self._space_waiters: list[asyncio.Future[None]] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self.counters = {"lower_hits": 0, "lower_hits_dropped": 0, "lower_write_failures": 0, "promotions": 0}

    async def open(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.memory.on_space_freed = self._space_freed
        for tier in self.lower:
            await tier.open()

    async def close(self) -> None:
        """Finish pending lower-tier writes, then close every tier."""
        if self._pending:
            await asyncio.gather(*self._pending.values(), return_exceptions=True)
        for tier in self.lower:
            await tier.close()
        self.memory.on_space_freed = None

    # -- PUT ----------------------------------------------------------------------------

    def reserve(self, length: int) -> Entry | None:
        return self.memory.reserve(length)

    async def reserve_wait(self, length: int, max_wait: float) -> Entry | None:
        """Reserve, waiting up to ``max_wait`` seconds for pinned memory to be released."""
        deadline = time.monotonic() + max_wait
        while True:
            entry = self.memory.reserve(length)
            if entry is not None:
                return entry
            if not await self._wait_for_space(deadline):
                return None

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

    @property
    def write_backlog_full(self) -> bool:
        return bool(self.lower) and self._pending_bytes >= self.write_behind_limit

    async def wait_write_backlog(self) -> None:
        while self.write_backlog_full:
            await asyncio.wait([*self._pending.values()], return_when=asyncio.FIRST_COMPLETED)

    def commit(self, key: str, entry: Entry, meta: ObjectMeta) -> asyncio.Future[bool] | None:
        """Publish a received object. Returns None when memory is the only tier, else a
        future that resolves to True once the first lower tier holds it."""
        if not self.lower:
            self.memory.commit(key, entry, meta)
            return None
        return self._commit_write_behind(key, entry, meta)

    def _commit_write_behind(self, key: str, entry: Entry, meta: ObjectMeta) -> asyncio.Future[bool]:
        self.memory.pin(entry)  # the write-behind's pin, dropped when the write ends
        self.memory.commit(key, entry, meta)
        previous = self._pending.get(key)
        loop = asyncio.get_running_loop()
        done: asyncio.Future[bool] = loop.create_future()
        self._pending[key] = done
        self._pending_bytes += entry.length
        task = loop.create_task(self._write_behind(key, entry, meta, previous, done))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return done

    async def _write_behind(
        self,
        key: str,
        entry: Entry,
        meta: ObjectMeta,
        previous: asyncio.Future[bool] | None,
        done: asyncio.Future[bool],
    ) -> None:
        ok = False
        try:
            if previous is not None:
                await asyncio.wait([previous])
            ok = await self.lower[0].put(key, entry.view, meta)
        except Exception:
            log.exception("lower tier write failed", tier=self.lower[0].name)
        finally:
            if not ok:
                self.counters["lower_write_failures"] += 1
            self._pending_bytes -= entry.length
            if self._pending.get(key) is done:
                del self._pending[key]
            self.memory.unpin(entry)
            done.set_result(ok)

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

    # -- GET ----------------------------------------------------------------------------

    def get(self, key: str) -> Entry | None:
        """A pinned memory hit (the caller unpins once sent), else None."""
        entry = self.memory.get(key)
        if entry is not None:
            for tier in self.lower:
                tier.touch(key)
        return entry

    def in_lower(self, key: str) -> bool:
        return key in self._pending or any(tier.contains(key) for tier in self.lower)

    async def fetch(self, key: str) -> Entry | None:
        """Read ``key`` from the lower tiers into a pinned memory entry (promoting it)."""
        pending = self._pending.get(key)
        if pending is not None:
            await asyncio.wait([pending])
            hit = self.memory.get(key)
            if hit is not None:
                return hit
        epoch = self._delete_epoch
        for tier in self.lower:
            if not tier.contains(key):
                continue
            reserved: list[Entry] = []

            def alloc(length: int, reserved: list[Entry] = reserved) -> memoryview:
                entry = self.memory.reserve(length)
                if entry is None:
                    raise NoSpace(f"no memory for a {length}-byte object read from a lower tier")
                reserved.append(entry)
                return memoryview(entry.buffer)[:length]

            meta = await self._read_waiting_for_memory(tier, key, alloc)
            if meta is None:
                for entry in reserved:
                    self.memory.abort(entry)
                continue
            entry = reserved[-1]
            self.counters["lower_hits"] += 1
            if epoch == self._delete_epoch and not self.memory.contains(key):
                self.memory.pin(entry)  # the reader's pin survives the commit
                if self.memory.commit_if_absent(key, entry, meta):
                    self.counters["promotions"] += 1
                    return entry
                self.memory.abort(entry)
                return self.memory.get(key)
            # Not promoted: hand out the private entry; the caller's unpin frees it.
            entry.meta = meta
            return entry
        return None

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
        return self.memory.contains(key) or (bool(self.lower) and self.in_lower(key))

    async def delete(self, key: str) -> bool:
        self._delete_epoch += 1
        pending = self._pending.get(key)
        if pending is not None:
            await asyncio.wait([pending])
        found = self.memory.delete(key)
        for tier in self.lower:
            found = await tier.delete(key) or found
        return found

    def keys(self, prefix: str = "", limit: int | None = None) -> list[str]:
        """Sorted, de-duplicated keys of every tier starting with ``prefix``."""
        sources: list[Iterable[str]] = [self.memory.keys(prefix)]
        sources += [tier.keys(prefix) for tier in self.lower]
        return list(itertools.islice(_unique(heapq.merge(*sources)), limit))

    def stats(self) -> dict[str, Any]:
        tiers: dict[str, Any] = {"memory": self.memory.usage()}
        for tier in self.lower:
            tiers[tier.name] = tier.usage().as_dict()
        return {
            "tiers": tiers,
            "write_behind": {"pending_objects": len(self._pending), "pending_bytes": self._pending_bytes},
            **self.counters,
        }


def _unique(keys: Iterator[str]) -> Iterator[str]:
    last = None
    for key in keys:
        if key != last:
            yield key
            last = key
