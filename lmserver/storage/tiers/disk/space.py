"""The disk tier's space: records admitted before they are written, LRU records evicted
ahead of need, and their blocks given back in the background, in large runs.

Strategy (the page cache's kswapd, Navy's clean-region pool):

* **Admission** (``admit``, on the log writer's placing thread): a record is written only
  once its bytes are booked in the ``LRUIndex``, beside every indexed record and every
  record whose blocks are not given back yet (*doomed*). So the tier's files never hold more
  than its capacity, not even for a moment, and the index counts it exactly.
* **Eviction ahead of need.** Giving blocks back costs the filesystem real time (punching a
  64 KiB record out of a segment measured ~120 us here, 64 MiB at once ~11 ms: about 10x less
  per byte), so once the tier is within ``ahead`` bytes of its capacity, LRU records are
  evicted in a batch and the ``Reclaimer`` punches them out together, adjacent records (the
  common case: what was written together ages together) as one range. A write waits only
  when freeing falls behind.
* Evicted records the next tier will take are held (still counted) until it has them; the
  tier decides that (``evicted``), this module only frees what it is given. Eviction does
  not run ahead while a tier behind takes victims (``ahead_allowed``): it would hand over
  more than that tier asked for, and a victim the held share cannot take is lost.

Thread-safe: the index has its own lock; the reclaimer is one thread.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable

import structlog

from ....logs import ThrottledWarnings
from ..lru_index import LRUIndex
from .records import Record
from .segments import SegmentSet, punch_hole

log = structlog.get_logger(__name__)

RECLAIM_WAIT_S = 10.0
"""How long a caller that needs evicted space back now (a full filesystem) waits for it."""
AHEAD_MAX = 64 * 1024 * 1024
"""Eviction runs at most this far ahead of need (and at most 1/16 of the capacity)."""


def default_ahead(capacity: int) -> int:
    return min(capacity // 16, AHEAD_MAX)


class Reclaimer:
    """The thread that gives evicted records' blocks back to the filesystem."""

    def __init__(self, index: LRUIndex[Record], segments: SegmentSet, *, punching: bool) -> None:
        self._index = index
        self._segments = segments
        self.punching = punching
        self._cond = threading.Condition()
        self._queue: list[Record] = []
        self._closing = False
        self.pending = 0  # bytes queued and not given back yet (doomed in the index meanwhile)
        # Without hole punching, a record's blocks come back only with its whole segment:
        # segment id -> bytes of released records still in it (doomed until it is unlinked).
        self._stuck: dict[int, int] = {}
        segments.on_removed = self._segment_removed
        self.punch_calls = 0
        self._warnings = ThrottledWarnings(log)
        self._thread = threading.Thread(target=self._run, name="lmserver-disk-reclaim", daemon=True)
        self._thread.start()

    def release(self, records: list[Record]) -> None:
        """Give these records' blocks back (their bytes are doomed in the index until then)."""
        with self._cond:
            self.pending += sum(r.size for r in records)
            if not self._closing:
                self._queue.extend(records)
                self._cond.notify_all()
                return
        self._free(records)

    def drain(self, timeout: float) -> None:
        """Block until everything queued is given back (or ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.pending > 0:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def wait_for_progress(self, timeout: float) -> None:
        """Block until a release completes (or ``timeout``): the admission's back-off."""
        with self._cond:
            self._cond.wait(timeout)

    def close(self) -> None:
        """Give back everything queued, then stop the thread."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                batch, self._queue = self._queue, []
                if not batch:
                    return
            self._free(batch)

    def _free(self, records: list[Record]) -> None:
        """Punch the records out, adjacent ones of a segment as one range, then forget them."""
        records = sorted(records, key=lambda r: (r.segment, r.offset))
        i = 0
        while i < len(records):
            first = records[i]
            end = first.offset + first.size
            j = i + 1
            while j < len(records) and records[j].segment == first.segment and records[j].offset == end:
                end += records[j].size
                j += 1
            punched = self._punch(first.segment, first.offset, end - first.offset)
            freed = 0
            for rec in records[i:j]:
                if punched:
                    self._index.forget(rec.size)
                else:
                    with self._cond:
                        self._stuck[rec.segment] = self._stuck.get(rec.segment, 0) + rec.size
                freed += rec.size
            for rec in records[i:j]:
                self._segments.drop_live(rec.segment)  # may unlink the segment: after the above
            with self._cond:
                self.pending -= freed
                self._cond.notify_all()
            i = j

    def _segment_removed(self, segment_id: int) -> None:
        with self._cond:
            stuck = self._stuck.pop(segment_id, 0)
        if stuck:
            self._index.forget(stuck)
            with self._cond:
                self._cond.notify_all()

    def _punch(self, segment_id: int, offset: int, length: int) -> bool:
        """Release the range's blocks; False if they stay until their segment is unlinked."""
        if not self.punching:
            return False
        segment = self._segments.acquire(segment_id)
        if segment is None:
            return True  # the segment is gone already, and its blocks with it
        try:
            punch_hole(segment.fd, offset, length)
            self.punch_calls += 1
            return True
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                self.punching = False
            self._warnings.warning("disk tier: could not release a record's space", error=str(exc))
            return False
        finally:
            self._segments.release(segment)


class Space:
    """Admission and eviction ahead of need over one tier's index."""

    def __init__(
        self,
        index: LRUIndex[Record],
        reclaimer: Reclaimer,
        *,
        ahead: int,
        evicted: Callable[[str, Record, bool], bool],
        ahead_allowed: Callable[[], bool] = lambda: True,
    ) -> None:
        self._index = index
        self._reclaimer = reclaimer
        self._ahead = ahead
        self._ahead_allowed = ahead_allowed
        self._evicted = evicted  # the tier: True if it holds the victim for the next tier
        self.waits = 0  # admissions that waited for space to come back
        self.fs_checked = 0.0  # when the filesystem's free space was last read (monotonic)
        self._fitting = threading.Lock()  # one thread at a time fits a full filesystem

    def admit(self, size: int, timeout: float, before_wait: Callable[[], None]) -> bool:
        """Book ``size`` bytes, evicting LRU records as needed and waiting up to ``timeout``
        seconds for their blocks to come back (calling ``before_wait`` first: the writer
        writes what it placed, so records being written can complete). False: it cannot fit
        in time (everything left is being written, freed or held for the next tier).

        A victim held for the next tier leaves room for *this* record (as one given back
        would), though its blocks stay until the next tier has it: the files then exceed
        the capacity by at most what one admission hands over, and later admissions evict
        to cover it (the held share bounds it: ``DiskTier.HELD_SHARE``)."""
        index = self._index
        deadline = time.monotonic() + timeout
        waited = False
        ahead = self.ahead
        handed = 0  # bytes of victims this admission handed to the next tier
        while not index.book(size, slack=handed):
            evicted, held = self.evict_down_to(
                index.capacity - size - min(ahead, max(0, index.capacity - size)) + handed
            )
            handed += held
            if evicted:
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if not waited:
                self.waits += 1
                waited = True
                before_wait()
            self._reclaimer.wait_for_progress(min(remaining, 0.05))
        if ahead and index.used - self._reclaimer.pending > index.capacity - ahead:
            self.evict_down_to(index.capacity - ahead)
        return True

    @property
    def ahead(self) -> int:
        """How far eviction runs ahead of need now (at most 1/16 of the capacity in use,
        which a full filesystem may have lowered)."""
        if not self._ahead_allowed():
            return 0
        return min(self._ahead, self._index.capacity // 16)

    def evict_down_to(self, target: int, *, hold: bool = True) -> tuple[int, int]:
        """Evict LRU records until what the tier holds, less what is on its way out (given
        back or handed over), is at most ``target`` bytes. Returns how many were evicted and
        the bytes of those held for the next tier. ``hold=False``: release every victim
        (holding one for the next tier would free nothing now)."""
        index = self._index
        releasing: list[Record] = []
        leaving = held = evicted = 0
        while index.used - self._reclaimer.pending - leaving > target:
            victim = index.evict_lru()
            if victim is None:
                break
            evicted += 1
            key, rec = victim
            leaving += rec.size
            if self._evicted(key, rec, hold):
                held += rec.size
            else:
                releasing.append(rec)
        if releasing:
            self._reclaimer.release(releasing)
        return evicted, held

    def fit_to_filesystem(self, path: os.PathLike[str], configured: int, index_room: int) -> tuple[int, int]:
        """A full filesystem: the capacity in use becomes our records + the free space - a
        margin (``index_room`` for the index to grow, plus 1/64 of the filesystem, at most
        1 GiB), never above ``configured``; evicts down to it, releasing victims at once
        (holding them for the next tier would free nothing) and waiting for their space.
        One thread at a time: writers that ran out together then evict once. Returns the
        capacity before and after; raises OSError if the free space cannot be read."""
        with self._fitting:
            st = os.statvfs(path)
            margin = index_room + min(max(st.f_blocks * st.f_frsize // 64, 16 * st.f_frsize), 1 << 30)
            index = self._index
            with index.lock:
                self.fs_checked = time.monotonic()
                before = index.capacity
                fits = index.bytes + index.doomed + st.f_bavail * st.f_frsize - margin
                index.capacity = after = max(0, min(configured, fits))
            self.evict_down_to(after, hold=False)
            self._reclaimer.drain(RECLAIM_WAIT_S)
        return before, after
