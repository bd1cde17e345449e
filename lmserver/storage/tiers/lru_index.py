"""The in-memory index and byte accounting a storage tier keeps over its backend.

Strategy: every tier behind memory answers EXIST/LIST from memory and must never exceed its
capacity, counting objects being written and evicted objects not yet removed. That logic is
the same whether the bytes live in files, NIXL slots or a bucket, so it is written once:

* ``records`` is an ordered dict in LRU order (least recently used first) of key -> record;
  a record is any object with a ``size`` attribute (bytes it occupies in the backend).
* ``reserve(size)`` makes room for a write before it starts: it takes LRU records out of
  the index (the *victims*) until ``size`` fits, and books ``size`` as *reserved*. The
  caller removes the victims from the backend before it writes, or hands them off to be
  demoted, booking them with ``hold`` until ``forget``. It then ``commit`` the new record
  (reserved becomes indexed) or ``cancel`` the reservation.
* *Doomed* bytes (held victims, removed records not yet deleted from the backend) count
  against the capacity: later reservations evict more to cover them.
* Invariant: ``bytes + reserved + doomed <= capacity``, except right after victims are held
  (at most what is held, until it is forgotten).

Thread-safe: one lock, short critical sections, no I/O under it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from sortedcontainers import SortedList


class Sized(Protocol):
    @property
    def size(self) -> int: ...


R = TypeVar("R", bound=Sized)


class LRUIndex(Generic[R]):
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.lock = threading.Lock()
        self.records: OrderedDict[str, R] = OrderedDict()
        self._sorted: SortedList = SortedList()
        self.bytes = 0
        self.reserved = 0
        self.doomed = 0

    # -- reading (no recency change unless asked) ----------------------------------------

    def __contains__(self, key: str) -> bool:
        return key in self.records  # one atomic dict lookup: no lock needed

    def __len__(self) -> int:
        return len(self.records)

    def get(self, key: str) -> R | None:
        return self.records.get(key)

    def touch(self, key: str) -> bool:
        """Mark ``key`` most recently used; False if absent."""
        with self.lock:
            if key not in self.records:
                return False
            self.records.move_to_end(key)
            return True

    def keys(self, prefix: str = "") -> list[str]:
        with self.lock:
            if not prefix:
                return list(self._sorted)
            out = []
            for key in self._sorted.irange(minimum=prefix):
                if not key.startswith(prefix):
                    break
                out.append(key)
            return out

    def lru_order(self) -> Iterator[tuple[str, R]]:
        """A snapshot, least recently used first (for persisting the order)."""
        with self.lock:
            return iter(list(self.records.items()))

    # -- writing ---------------------------------------------------------------------------

    def load(self, key: str, record: R) -> None:
        """Add a record found at startup, as the most recently used (no capacity check:
        call ``overflow()`` after loading)."""
        with self.lock:
            old = self.records.pop(key, None)
            if old is not None:
                self.bytes -= old.size
                self._sorted.remove(key)
            self._put_locked(key, record)

    def load_all(self, records: OrderedDict[str, R]) -> None:
        """Take an empty index's records at startup in one go (LRU order, least recently
        used first; no capacity check: call ``overflow()`` after). 100,000 records: a
        tenth of ``load`` one by one, most of it the sorted key list built at once."""
        with self.lock:
            if self.records:
                raise ValueError("load_all needs an empty index")
            self.records = records
            self._sorted = SortedList(records)
            self.bytes = sum(record.size for record in records.values())

    def adopt(self, key: str, record: R) -> R:
        """Add a record found in the backend (a shared tier's probe), as the most recently
        used, unless ``key`` has one meanwhile; returns the record the index now holds (no
        capacity check: call ``overflow()`` after)."""
        with self.lock:
            current = self.records.get(key)
            if current is not None:
                return current
            self._put_locked(key, record)
        return record

    def reserve(self, size: int) -> list[tuple[str, R]] | None:
        """Book ``size`` bytes, taking LRU records out of the index as needed. Returns the
        victims (possibly none), or None if even evicting everything cannot make room now
        (the rest is reserved or doomed by work in flight)."""
        with self.lock:
            if self.reserved + self.doomed + size > self.capacity:
                return None
            victims = []
            while self.records and self.bytes + self.reserved + self.doomed + size > self.capacity:
                victims.append(self._evict_locked())
            self.reserved += size
            return victims

    def book(self, size: int, *, slack: int = 0) -> bool:
        """Book ``size`` bytes if they fit now beside what is indexed, reserved and doomed
        (no eviction: a caller that frees space in the background evicts with
        ``evict_lru`` and books again once the space is back). ``slack``: doomed bytes the
        caller counts as gone already (victims it handed off to be demoted)."""
        with self.lock:
            if self.bytes + self.reserved + self.doomed - slack + size > self.capacity:
                return False
            self.reserved += size
            return True

    def evict_lru(self) -> tuple[str, R] | None:
        """Take the least recently used record out of the index, its bytes doomed until
        ``forget``; None when the index is empty."""
        with self.lock:
            if not self.records:
                return None
            return self._evict_locked(hold=True)

    @property
    def used(self) -> int:
        """Bytes indexed, reserved and doomed: what the backend may hold at most."""
        return self.bytes + self.reserved + self.doomed

    def hold(self, size: int) -> None:
        """Victims kept in the backend (handed off for demotion) until ``forget``."""
        with self.lock:
            self.doomed += size

    def commit(self, key: str, record: R, reserved: int, *, doom_old: bool = False) -> R | None:
        """Index a written object whose space was reserved; returns the record it replaced
        (whose bytes the caller must remove from the backend unless it wrote in place;
        ``doom_old``: they stay counted as doomed until ``forget``)."""
        with self.lock:
            self.reserved -= reserved
            old = self.records.pop(key, None)
            if old is not None:
                self.bytes -= old.size
                self._sorted.remove(key)
                if doom_old:
                    self.doomed += old.size
            self._put_locked(key, record)
            return old

    def cancel(self, reserved: int) -> None:
        with self.lock:
            self.reserved -= reserved

    def remove(self, key: str, record: R | None = None, *, doom: bool = True) -> R | None:
        """Drop ``key`` (only if its record is ``record``, when given). Its bytes become
        doomed until ``forget`` (``doom=False``: they are already gone from the backend)."""
        with self.lock:
            current = self.records.get(key)
            if current is None or (record is not None and current is not record):
                return None
            del self.records[key]
            self._sorted.remove(key)
            self.bytes -= current.size
            if doom:
                self.doomed += current.size
            return current

    def forget(self, size: int) -> None:
        """Doomed bytes that are now really gone from the backend."""
        with self.lock:
            self.doomed -= size

    def overflow(self) -> list[tuple[str, R]]:
        """Take LRU records out until the index fits its capacity (after loading, or after
        the capacity was lowered); the caller removes (or holds) the victims."""
        with self.lock:
            victims = []
            while self.records and self.bytes + self.reserved + self.doomed > self.capacity:
                victims.append(self._evict_locked())
            return victims

    def _put_locked(self, key: str, record: R) -> None:
        self.records[key] = record
        self._sorted.add(key)
        self.bytes += record.size

    def _evict_locked(self, hold: bool = False) -> tuple[str, R]:
        key, record = self.records.popitem(last=False)
        self._sorted.remove(key)
        self.bytes -= record.size
        if hold:
            self.doomed += record.size
        return key, record
