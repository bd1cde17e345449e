"""A size-class pool of reusable object buffers, bounded in bytes.

Strategy: a fresh 32 MiB buffer costs page faults on every PUT (measured 3x slower than
reuse here), while KV-cache chunks come in a handful of fixed sizes. So buffers are kept on
per-size-class free lists and handed out again. Classes round a length up to 1/16 of its
power of two (4 KiB minimum), wasting at most ~6%.

Buffers are slots carved out of *slabs*: private anonymous ``mmap``s per size class, each
twice the one before up to ``SLAB_BYTES`` (64 MiB), or one slot each for classes that large.
A dropped buffer's pages go back to the OS at once (``MADV_DONTNEED``; its slot is handed
out again later as a fresh one), and a slab whose slots are all dropped is unmapped.
(``bytearray`` buffers came from malloc's heap, which glibc keeps fragmented: a long
overwrite run reached 1.7x ``--memory-limit`` in RSS while the pool's accounting stayed
under it.) Pages are untouched until written: a buffer costs RSS only as its body arrives.

Why slabs and not one mapping per buffer: Linux allows a process ``vm.max_map_count``
mappings (65,530 by default), and each mapping the kernel cannot merge with its neighbour
counts. With one shared mapping per buffer (Python's ``mmap`` default, which never merges)
a store of 4 KiB objects failed at ~65,000 objects, far below its memory limit, and the
failed ``mmap`` took down whatever needed a mapping next (a connection's reply buffer);
private mappings merge, but dropping scattered idle buffers split them again (52,000
mappings after a few rounds of deleting and refilling 100,000 of 300,000 objects). With
slabs the pool holds about ``memory / 64 MiB`` mappings (and a few more per size class in
use) plus one per object of 64 MiB or more, whatever the object sizes and the order they
come and go in.

Capacity is counted in class bytes, for buffers in use *and* on free lists, so the pool
never holds more memory than it was given, plus ``object_overhead`` per buffer in use (the
memory tier's estimate of an object's metadata). When a class has no free buffer and the budget
is spent, free buffers of other classes are dropped (their memory goes back to the OS)
before the caller is told to evict.

A fresh buffer may be *charged* partially (``acquire_partial``) and grow its charge as it
is filled (``charge``): a PUT whose body has not arrived then holds only what it has
received, not what its header announced. A partially charged buffer is never reused (its
pages are counted as untouched); it is dropped on release.

Fresh pages are *populated* as they are charged (``populate``), before the socket writes
into them: one ``madvise(MADV_POPULATE_WRITE)`` over the charged range instead of a page
fault per 4 KiB. Measured here, writing 4 MiB into fresh memory: 1.36 to 1.50 GB/s faulting
page by page, 1.95 to 2.07 GB/s populated (2026-12-02; ``mmap(MAP_FIXED | MAP_POPULATE)``,
used before, was as fast, but it replaced the range by a mapping of its own, which took the
mmap lock for writing and did not keep its slab's advice). Only bytes already charged are
populated, so RSS still follows what a body has sent. Ranges under 1 MiB are left to fault
(``POPULATE_MIN``).
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from typing import Any

import structlog

log = structlog.get_logger("lmserver.storage.pool")

_MIN_CLASS = 4096
SLAB_BYTES = 64 << 20
"""The largest slab: a class's slabs double from ``FIRST_SLAB_BYTES`` (its mapped total so
far) up to this, so a class in little use maps little (in address space and in the commit
charge of a strict-overcommit host) and a busy one maps one slab per 64 MiB."""
FIRST_SLAB_BYTES = 1 << 20
_NO_HUGE_PAGES: int = getattr(mmap, "MADV_NOHUGEPAGE", 0)

Buffer = memoryview
"""A buffer: one slot of a slab, ``len()`` its size class, writable."""


class _Slab:
    """One private anonymous mapping cut into equal slots of one size class."""

    __slots__ = ("cls", "fresh", "listed", "map", "slots", "unused", "used", "whole")

    def __init__(self, cls: int, slots: int) -> None:
        self.cls = cls
        self.slots = slots
        # Private, not mmap's default shared: private anonymous mappings next to each other
        # merge into one kernel mapping, shared ones (each its own shmem object) never do.
        self.map = mmap.mmap(-1, self.slots * cls, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if _NO_HUGE_PAGES:
            # Where transparent huge pages are "always", a huge page may span slots: one
            # 4 KiB object could fault in 2 MiB, and khugepaged could fill dropped slots back
            # in, RSS past the limit. (One mapping per buffer never had the problem.)
            self.map.madvise(_NO_HUGE_PAGES)
        self.whole = memoryview(self.map)
        self.fresh: list[tuple[Buffer, int]] = []  # dropped slots (pages given back), by offset
        self.unused = 0  # slots [unused, slots) were never handed out
        self.used = 0  # slots handed out and not dropped: in use, lent or idle
        self.listed = False  # in the pool's list of slabs with a fresh or unused slot

    def has_room(self) -> bool:
        return bool(self.fresh) or self.unused < self.slots

    def take(self) -> tuple[Buffer, int]:
        """A fresh slot (untouched pages) and its offset in the mapping."""
        self.used += 1
        if self.fresh:
            return self.fresh.pop()
        offset = self.unused * self.cls
        self.unused += 1
        return self.whole[offset : offset + self.cls], offset


def size_class(length: int) -> int:
    """The buffer size that serves an object of ``length`` bytes."""
    if length <= _MIN_CLASS:
        return _MIN_CLASS
    granule = max(_MIN_CLASS, 1 << (length.bit_length() - 5))
    return -(-length // granule) * granule


class BufferPool:
    """Thread-safe; all methods are short critical sections."""

    def __init__(self, capacity: int, object_overhead: int = 0) -> None:
        self.capacity = capacity
        # Charged per buffer handed out, for what its owner keeps beside it (the memory
        # tier's per-object metadata): RSS the capacity covers too.
        self.object_overhead = object_overhead
        self._overhead = 0  # object_overhead per buffer handed out, not yet released or lent
        self._lock = threading.Lock()
        self._free: dict[int, list[Buffer]] = {}
        self._open_slabs: dict[int, list[_Slab]] = {}  # per class: slabs with room, newest last
        self._home: dict[int, tuple[_Slab, int]] = {}  # id(buffer) -> its slab and offset
        self._mapped_slots: dict[int, int] = {}  # per class: slots of its slabs
        self._slabs = 0
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
        self.map_failures = 0

    @property
    def in_use(self) -> int:
        return self._in_use

    @property
    def idle(self) -> int:
        return self._idle

    @property
    def lent(self) -> int:
        return self._lent

    @property
    def overhead(self) -> int:
        """``object_overhead`` times the buffers handed out (and not lent)."""
        return self._overhead

    @property
    def mappings(self) -> int:
        """Slabs mapped now: the memory mappings the pool holds."""
        return self._slabs

    @property
    def mapped_bytes(self) -> int:
        """Address space the slabs take (resident only where written)."""
        return sum(cls * slots for cls, slots in self._mapped_slots.items())

    def set_lend_limit(self, limit: int) -> None:
        with self._lock:
            self.lend_limit = limit

    def lend(self, buf: Buffer) -> bool:
        """Move an in-use buffer to the lent share, if it has room."""
        cls = len(buf)
        with self._lock:
            if self._lent + cls > self.lend_limit:
                return False
            self._in_use -= cls
            self._overhead -= self.object_overhead  # its object is gone from its owner
            self._lent += cls
            return True

    def unlend(self, buf: Buffer) -> None:
        """Undo ``lend`` (the object was not evicted after all)."""
        cls = len(buf)
        with self._lock:
            self._lent -= cls
            self._overhead += self.object_overhead
            self._in_use += cls

    def acquire(self, length: int) -> Buffer | None:
        """A buffer of at least ``length`` bytes, or None when the budget is spent."""
        got = self.acquire_partial(length, size_class(length))
        return None if got is None else got[0]

    def acquire_partial(self, length: int, charge: int) -> tuple[Buffer, int] | None:
        """A buffer of at least ``length`` bytes and the bytes charged for it: a reused
        buffer is charged in full (its pages are resident), a fresh one ``charge`` bytes
        (at most its class); None when the budget is spent."""
        cls = size_class(length)
        with self._lock:
            free = self._free.get(cls)
            charge = cls if free else min(cls, charge)
            cost = charge + self.object_overhead
            if self._in_use + self._overhead + cost > self.capacity - self.lend_limit:
                return None
            if free:
                self._idle -= cls
                self._in_use += cls
                self._overhead += self.object_overhead
                self._idle_low = min(self._idle_low, self._idle)
                self.reuses += 1
                return free.pop(), cls
            self._trim_locked(self.capacity - self._in_use - self._overhead - self._lent - cost)
            self._idle_low = min(self._idle_low, self._idle)
            try:
                buf = self._take_fresh(cls)
            except OSError as exc:
                # No mapping to be had (the OS is out of memory or of mappings): answered as
                # a full pool, after giving back every idle buffer, which may free a slab.
                self.map_failures += 1
                self._trim_locked(0)
                log.warning("mapping a slab failed", size_class=cls, error=str(exc))
                return None
            self._in_use += charge
            self._overhead += self.object_overhead
            self.fresh_allocations += 1
        # Outside the lock: the charged part is populated now, the rest as the charge grows.
        populate(buf, 0, charge)
        return buf, charge

    def _take_fresh(self, cls: int) -> Buffer:
        """A slot never written since it was mapped or dropped (the lock is held)."""
        open_slabs = self._open_slabs.setdefault(cls, [])
        if open_slabs:
            slab = open_slabs[-1]
        else:
            mapped = self._mapped_slots.get(cls, 0)
            slots = min(max(FIRST_SLAB_BYTES // cls, mapped), SLAB_BYTES // cls)
            slab = _Slab(cls, max(1, slots))
            slab.listed = True
            open_slabs.append(slab)
            self._mapped_slots[cls] = mapped + slab.slots
            self._slabs += 1
        buf, offset = slab.take()
        self._home[id(buf)] = (slab, offset)
        if not slab.has_room():
            open_slabs.pop()
            slab.listed = False
        return buf

    def _drop(self, buf: Buffer) -> None:
        """Give a buffer's pages back to the OS; its slot becomes fresh (the lock is held, and
        nobody references the buffer any more). A slab with no slot left in use is unmapped."""
        slab, offset = self._home[id(buf)]
        slab.used -= 1
        if slab.used:
            slab.map.madvise(mmap.MADV_DONTNEED, offset, slab.cls)
            slab.fresh.append((buf, offset))
            if not slab.listed:
                # Taken from next, before slabs with more room: those may drain and go.
                slab.listed = True
                self._open_slabs[slab.cls].append(slab)
            return
        for view, _ in slab.fresh:
            del self._home[id(view)]
        del self._home[id(buf)]
        slab.fresh.clear()
        if slab.listed:
            self._open_slabs[slab.cls].remove(slab)
        self._mapped_slots[slab.cls] -= slab.slots
        self._slabs -= 1
        # No close(): the mapping goes with the last reference to it, so a view that is
        # still around (a caller's bug) can never point at unmapped memory.

    def charge(self, nbytes: int) -> bool:
        """Count ``nbytes`` more of a partially charged buffer; False when the budget is spent
        (idle buffers are dropped first to make room)."""
        with self._lock:
            if self._in_use + self._overhead + nbytes > self.capacity - self.lend_limit:
                return False
            self._trim_locked(self.capacity - self._in_use - self._overhead - self._lent - nbytes)
            self._idle_low = min(self._idle_low, self._idle)
            self._in_use += nbytes
            return True

    def release(self, buf: Buffer, charged: int | None = None, *, lent: bool = False) -> None:
        """Return a buffer (in use and charged ``charged`` bytes, default in full; or
        ``lent``); it must no longer be referenced by anyone."""
        cls = len(buf)
        with self._lock:
            if lent:
                self._lent -= cls  # its overhead went when it was lent
            else:
                self._overhead -= self.object_overhead
                if charged is not None and charged < cls:
                    self._in_use -= charged  # partially filled: not worth keeping, dropped
                    self._drop(buf)
                    return
                self._in_use -= cls
            # Its bytes were counted against capacity when acquired: keeping it idle fits.
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
                self._drop(free.pop())
                self._idle -= cls
            if not free:
                del self._free[cls]


_PAGE = mmap.PAGESIZE
POPULATE_MIN = 1 << 20
"""Smaller ranges fault page by page: a call costs more than a few faults where threads
touching memory (tier writers) contend for the process's mmap lock (measured with the disk
tier under 64 KiB PUTs and the MAP_FIXED populate used before, one populate of a 64 KiB
buffer cost ~350 us on the event loop against ~16 us of faults), while from 1 MiB up one
call replaces 256+ faults."""
_POPULATE_WRITE = 23  # MADV_POPULATE_WRITE (Linux 5.14), not named by Python 3.11's mmap
_madvise_fn: Any = None  # libc madvise, while populating works
if sys.platform == "linux":
    _madvise_fn = ctypes.CDLL(None, use_errno=True).madvise
    _madvise_fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def populate(buf: Buffer, start: int, end: int) -> None:
    """Fault in the whole pages of ``buf[start:end]`` at once (a speed-up only; the pages'
    contents are kept). Partial pages at either end are left to fault on their own."""
    global _madvise_fn
    first = -(-start // _PAGE) * _PAGE
    last = min(end, len(buf)) // _PAGE * _PAGE
    if _madvise_fn is None or last - first < POPULATE_MIN:
        return
    anchor = ctypes.c_char.from_buffer(buf)  # an export of the buffer, for its address only
    addr = ctypes.addressof(anchor) + first
    del anchor
    if _madvise_fn(addr, last - first, _POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        if errno == 22:  # EINVAL: a kernel before 5.14; pages fault in one by one from now on
            _madvise_fn = None
            log.warning("populating buffers is not supported; pages fault in one by one")
        # Any other error (ENOMEM): left to the faults of the write that follows.
