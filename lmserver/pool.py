"""A size-class pool of reusable object buffers, bounded in bytes.

Strategy: a fresh ``bytearray(32 MiB)`` costs page faults and a memset on every PUT
(measured 3x slower than reuse here), while KV-cache chunks come in a handful of fixed
sizes. So buffers are kept on per-size-class free lists and handed out again. Classes round
a length up to 1/16 of its power of two (4 KiB minimum), wasting at most ~6%.

Capacity is counted in class bytes, for buffers in use *and* on free lists, so the pool
never holds more memory than it was given. When a class has no free buffer and the budget
is spent, free buffers of other classes are dropped (their memory goes back to the OS)
before the caller is told to evict.
"""

from __future__ import annotations

import threading

_MIN_CLASS = 4096


def size_class(length: int) -> int:
    """The buffer size that serves an object of ``length`` bytes."""
    if length <= _MIN_CLASS:
        return _MIN_CLASS
    granule = max(_MIN_CLASS, 1 << (length.bit_length() - 5))
    return -(-length // granule) * granule


class BufferPool:
    """Thread-safe; all methods are short critical sections."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}
        self._in_use = 0  # class bytes handed out and not yet released
        self._idle = 0  # class bytes sitting on free lists
        self._idle_low = 0  # the fewest idle bytes since the last trim_unused()
        # Buffers of evicted objects still being demoted to the next tier are *lent*: they no
        # longer count as in use (so eviction frees room at once) but come out of a share of
        # the capacity set aside for them, so the total never exceeds the capacity.
        self.lend_limit = 0
        self._lent = 0
        self.fresh_allocations = 0
        self.reuses = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def idle(self) -> int:
        return self._idle

    @property
    def lent(self) -> int:
        return self._lent

    def set_lend_limit(self, limit: int) -> None:
        with self._lock:
            self.lend_limit = limit

    def lend(self, buf: bytearray) -> bool:
        """Move an in-use buffer to the lent share, if it has room."""
        cls = len(buf)
        with self._lock:
            if self._lent + cls > self.lend_limit:
                return False
            self._in_use -= cls
            self._lent += cls
            return True

    def acquire(self, length: int) -> bytearray | None:
        """A buffer of at least ``length`` bytes, or None when the budget is spent."""
        cls = size_class(length)
        with self._lock:
            if self._in_use + cls > self.capacity - self.lend_limit:
                return None
            free = self._free.get(cls)
            if free:
                self._idle -= cls
                self._in_use += cls
                self._idle_low = min(self._idle_low, self._idle)
                self.reuses += 1
                return free.pop()
            self._trim_locked(self.capacity - self._in_use - self._lent - cls)
            self._idle_low = min(self._idle_low, self._idle)
            self._in_use += cls
            self.fresh_allocations += 1
        # Allocate outside the lock: a large bytearray is a page-faulting memset.
        return bytearray(cls)

    def release(self, buf: bytearray, *, lent: bool = False) -> None:
        """Return a buffer (in use, or ``lent``); it must no longer be referenced by anyone."""
        cls = len(buf)
        with self._lock:
            # Its bytes were counted against capacity when acquired: keeping it idle fits.
            if lent:
                self._lent -= cls
            else:
                self._in_use -= cls
            self._free.setdefault(cls, []).append(buf)
            self._idle += cls

    def trim_unused(self) -> int:
        """Give back to the OS the idle bytes no acquire needed since the last call.

        Called periodically: a steady workload keeps reusing its buffers and loses none,
        while buffers left over from a burst or an older object size stop holding RSS.
        Returns the bytes dropped.
        """
        with self._lock:
            before = self._idle
            self._trim_locked(self._idle - self._idle_low)
            self._idle_low = self._idle
            return before - self._idle

    def _trim_locked(self, keep: int) -> None:
        # Drop the largest idle classes first: fewest buffers freed for the most room.
        for cls in sorted(self._free, reverse=True):
            if self._idle <= keep:
                return
            free = self._free[cls]
            while free and self._idle > keep:
                free.pop()
                self._idle -= cls
            if not free:
                del self._free[cls]
