"""DiskTier: a capacity-bounded, persistent LRU object store on a local filesystem, written
as a log.

Strategy (the pieces live beside this file):

* **Layout** (``segments``): records are appended to segment files under
  ``<root>/segments/``; each record is self-describing (``_diskfile``'s header: key, lengths,
  CRC-32s, v1 metadata). Writing goes through ``writer.LogWriter``: small records combined
  into large aligned writes, large ones straight from memory with O_DIRECT, so a stream of
  64 KiB objects reaches the disk in megabyte writes (one file per object cost a create, a
  rename and an fsync'd directory entry each: 37-80 MB/s on a disk that takes 1.2 GB/s).
* **Index**: ``LRUIndex`` (shared with the other tiers) in memory answers ``contains``,
  ``keys`` and ``usage`` without I/O and counts capacity exactly (a record's padded size, and
  space not yet released); SQLite (``index``) mirrors it for fast restarts, written from one
  background thread, never awaited. GET hits update recency in memory and reach SQLite in
  batches (at most every ``recency_flush_s`` seconds or 4096 keys, and at close).
* **Space** comes back per object: an evicted, deleted or overwritten record's blocks are
  punched out of its segment (``fallocate``), so eviction is exact LRU with no compaction; a
  segment with nothing left in it is unlinked. Evicted records can be handed to the next
  tier first (kept, counted, until it has them: at most 1/``HELD_SHARE`` of the capacity).
* **Restart** (``recovery``): rows load in LRU order without reading records; after a crash,
  records above each segment's persisted watermark are read back in, so an acknowledged
  PUT survives a SIGKILL under every ``fsync`` policy.
* **Integrity**: every read checks the header (key, lengths, metadata) and the body's CRC: a
  torn or corrupted record is a miss (counted ``corrupt``, punched out), never wrong data.
* **A full filesystem** (ENOSPC, EDQUOT) means the configured capacity is more than the real
  space: the tier lowers its *effective* capacity to its own bytes plus the free space, less a
  margin, evicts LRU objects down to it and retries the write (a few times); while lowered,
  the free space is re-read at most once a second, so the capacity rises again with it.
* **A removed directory** (``rm -rf`` of ``segments/`` under a running server) is noticed
  within a second of the next write: its records are dropped (counted ``missing``), the
  directory is made again and writing goes on in a new segment.

fsync policies (``fsync=``): ``never`` (default: a cache can recompute any object, and an
fsync per write caps throughput; a written record survives a process crash, a power loss
can only cause misses, caught by the checksums); ``always``: the segment is fdatasync'ed
after each write, before its records count as stored; ``batch``: like ``always``, one
fdatasync covering the writes of up to ``batch_window_s`` (10 ms).

All blocking work (file I/O, fsync, SQLite) runs in threads; the event loop never blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, get_args

import structlog

from lmproto import ObjectMeta

from ....logs import ThrottledWarnings
from .. import _diskfile
from ..base import COMMON_COUNTERS, Alloc, ConfigError, Tier, TierUsage
from ..lru_index import LRUIndex
from ..spec import Mode, TierSpec
from ..threaded import Completions, TierClosed, Workers, uncancellable
from . import index as dbindex
from . import recovery
from .recency import Recency
from .records import Record, read_checked, record_size
from .segments import Segment, SegmentSet, punch_works
from .space import RECLAIM_WAIT_S, Reclaimer, Space, default_ahead
from .victim import DiskVictim
from .writer import COMBINE_MAX, Append, FsyncPolicy, LogWriter

log = structlog.get_logger("lmserver.storage.tiers.disk")

FSYNC_POLICIES: tuple[FsyncPolicy, ...] = get_args(FsyncPolicy)
DEFAULT_FSYNC: FsyncPolicy = "never"
DEFAULT_CAPACITY = 64 * 1024**3
DEFAULT_WORKERS = 8
"""Threads for reads (and as many for writes): 64 KiB GETs from disk measured 10% faster with
8 than with 4 here; they cost nothing while idle."""
DirectPolicy = Literal["auto", "off"]
DIRECT_POLICIES: tuple[DirectPolicy, ...] = get_args(DirectPolicy)
DEFAULT_DIRECT: DirectPolicy = "auto"
DIRECT_MIN = COMBINE_MAX + 1
"""Bodies at least this large are written with O_DIRECT from their own memory; smaller ones
are combined into large writes (``writer.COMBINE_MAX``)."""
HELD_SHARE = 8
"""Evicted records waiting for demotion may hold at most 1/HELD_SHARE of the capacity."""

ADMIT_TIMEOUT_S = 10.0
"""How long a write may wait for evicted records' space to come back before it is declined
(freeing is fast; this bounds a filesystem that stops answering)."""
_WARN_INTERVAL_S = 10.0
_SPACE_RECHECK_S = 1.0
_DIRECTORY_CHECK_S = 1.0


class DiskTier(Tier):
    """A capacity-bounded LRU object store on a local filesystem. See the module docstring.

    Lifecycle: ``tier = DiskTier(path, capacity=...)``, ``await tier.open()`` once, then use
    from the event loop it was opened on, then ``await tier.close()``. ``put`` reads ``data``
    until it returns; ``get_into`` calls ``alloc`` on the calling thread (before any I/O) and
    writes into the buffer until it returns; neither returns early, even when cancelled.
    """

    default_mode: Mode = "write-behind"

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DiskTier:
        """``disk:PATH?capacity=64GiB&fsync=never&workers=8&direct=auto``."""
        if not spec.target:
            raise ConfigError(f"tier {spec}: a disk tier needs a directory (disk:/path)")
        return cls(
            spec.target,
            capacity=spec.size("capacity", DEFAULT_CAPACITY, minimum=1),
            fsync=spec.choice("fsync", FSYNC_POLICIES, DEFAULT_FSYNC),
            max_workers=spec.integer("workers", DEFAULT_WORKERS, minimum=1, maximum=256),
            direct=spec.choice("direct", DIRECT_POLICIES, DEFAULT_DIRECT),
            name=spec.string("name", "disk"),
        )

    def __init__(
        self,
        path: Path | str,
        *,
        capacity: int,
        fsync: FsyncPolicy = DEFAULT_FSYNC,
        max_workers: int = DEFAULT_WORKERS,
        batch_window_s: float = 0.010,
        check_files: bool | None = None,
        recency_flush_s: float = 1.0,
        direct: DirectPolicy = DEFAULT_DIRECT,
        name: str = "disk",
        evict_ahead: int | None = None,
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        if direct not in DIRECT_POLICIES:
            raise ValueError(f"direct must be one of {DIRECT_POLICIES}, not {direct!r}")
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.path = Path(path)
        self.capacity = capacity  # as configured; the index's capacity is the effective one
        self.fsync: FsyncPolicy = fsync
        self.check_files = check_files
        self.direct = direct
        self.direct_io = False  # whether O_DIRECT writes are in use (probed at open)
        self.punching = True  # whether the filesystem releases punched records (probed)
        self._max_workers = max_workers
        self._batch_window_s = batch_window_s
        self._recency_flush_s = recency_flush_s
        self._evict_ahead = default_ahead(capacity) if evict_ahead is None else evict_ahead
        self._segment_dir = str(self.path / "segments")
        self._db_path = self.path / "index.sqlite3"

        self._index: LRUIndex[Record] = LRUIndex(capacity)
        self._segments = SegmentSet(self._segment_dir)
        self._mu = threading.Lock()  # counters, recency batch, the held share
        self._recency: Recency | None = None
        self._held = 0  # evicted records handed off for demotion, not yet released
        self._directory_checked = time.monotonic()
        self._counters = dict.fromkeys(
            (
                *COMMON_COUNTERS,
                "write_errors",
                "out_of_space",
                "read_errors",
                "declined_too_large",
                "declined_no_space",
                "declined_invalid",
                "demotions_dropped",
                "device_writes",
                "device_write_bytes",
            ),
            0,
        )
        self._warnings = ThrottledWarnings(log, _WARN_INTERVAL_S)
        self._workers: Workers | None = None
        self._reclaimer: Reclaimer | None = None
        self._space: Space | None = None
        self._writer: LogWriter | None = None
        self._db: dbindex.IndexWriter | None = None
        self._lock_fd: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._completions: Completions | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def effective_capacity(self) -> int:
        """The capacity in use: lower than configured while the filesystem holds less."""
        return self._index.capacity

    async def open(self) -> None:
        if self._workers is not None:
            raise RuntimeError("DiskTier.open() called twice")
        self._loop = asyncio.get_running_loop()
        self._completions = Completions(self._loop)
        self._workers = Workers(self._max_workers, "disk")
        try:
            await self._workers.run(self._open_sync)
        except BaseException as exc:
            self._closed = True
            self._workers.shutdown(wait=False)
            self._segments.close()
            self._release_lock()
            if recovery.filesystem_full(exc, self.path):  # an operator's problem: say so plainly
                raise OSError(errno.ENOSPC, f"disk tier {self.path}: the filesystem is full ({exc})") from exc
            raise

    def _open_sync(self) -> None:
        started = time.monotonic()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"disk tier directory {self.path} is in use by another process") from None
        if not os.path.isdir(self._segment_dir):
            os.makedirs(self._segment_dir, exist_ok=True)
            _fsync_dir(str(self.path))  # the new directory itself, once
        if os.path.isdir(self.path / "objects"):
            log.warning(
                "disk tier: this directory holds objects of the file-per-object layout, which this"
                " version does not read; remove the folder to get its space back",
                folder=str(self.path / "objects"),
            )
        self.direct_io = self.direct == "auto" and _diskfile.direct_io_works(self._segment_dir)
        self.punching = punch_works(self._segment_dir)
        if not self.punching:
            self._warn("disk tier: the filesystem cannot punch holes; space comes back a segment at a time")
        self._segments.open_existing()
        loaded = recovery.load(self._db_path, self._segments, check_files=self.check_files)
        try:
            self._counters["missing"] += loaded.missing
            self._index.load_all(loaded.records)
            for segment_id, live in Counter(rec.segment for rec in loaded.records.values()).items():
                segment = self._segments.get(segment_id)
                if segment is not None:
                    self._segments.add_live(segment, live)
            self._drop_empty_segments()
            dbindex.set_meta_durably(loaded.conn, "clean", "0")
        except BaseException:
            loaded.conn.close()
            raise
        self._db = db = dbindex.IndexWriter(
            loaded.conn, idle_s=self._recency_flush_s, on_idle=self._flush_recency
        )
        self._recency = Recency(self._recency_flush_s, db.submit, loaded.clock)
        self._reclaimer = Reclaimer(self._index, self._segments, punching=self.punching)
        self._space = Space(
            self._index,
            self._reclaimer,
            ahead=self._evict_ahead,
            evicted=self._evicted,
            ahead_allowed=lambda: self.on_evict is None,
        )
        over, _held = self._space.evict_down_to(self._index.capacity)
        if over:
            log.info("disk tier over capacity at open: evicted", objects=over)
        self._writer = LogWriter(
            self._segments,
            fsync=self.fsync,
            direct=self.direct_io,
            threads=self._max_workers,
            window_s=self._batch_window_s,
            admit=self._admit,
            on_safe=self._watermark_moved,
            on_no_space=self._make_room,
        )
        log.info(
            "disk tier opened",
            path=str(self.path),
            objects=len(self._index),
            bytes=self._index.bytes,
            capacity=self.capacity,
            fsync=self.fsync,
            direct_io=self.direct_io,
            segments=len(self._segments),
            index=loaded.source,
            reconciled=loaded.reconciled,
            seconds=round(time.monotonic() - started, 3),
        )

    def _drop_empty_segments(self) -> None:
        for segment in self._segments:
            if segment.live == 0:
                self._segments.seal(segment)  # nothing lives in it: unlinked now

    async def close(self) -> None:
        """Finish in-flight work, flush recency and the index, mark the index clean."""
        if self._closed or self._workers is None:
            self._closed = True
            return
        self._closed = True
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        assert self._workers is not None
        if self._writer is not None:
            self._writer.close()  # every queued record written
        self._workers.shutdown(wait=True)
        if self._reclaimer is not None:
            self._reclaimer.close()
        if self._db is not None:
            self._flush_recency(force=True)
            # Records still held for the next tier are in no row: leave the index unclean, so
            # the next open gives their space back (it reconciles with the segments).
            if self._db.errors == 0 and self._held == 0:
                self._db.submit(dbindex.set_meta_op("clean", "1"))
            self._db.close()
        self._segments.close()
        self._release_lock()
        log.info("disk tier closed", path=str(self.path), objects=len(self._index), bytes=self._index.bytes)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    async def sync_index(self) -> None:
        """Wait until SQLite holds every index change made so far (recency excepted; tests)."""
        if self._db is not None and not self._closed:
            await asyncio.wrap_future(self._db.flush())

    async def settle(self) -> None:
        """Wait until the space of every record that left the index is given back, and
        SQLite holds every change (tests and benchmarks compare with the files then)."""
        if self._reclaimer is not None and not self._closed:
            await asyncio.to_thread(self._reclaimer.drain, RECLAIM_WAIT_S)
        await self.sync_index()

    # -- Tier interface: lookups -----------------------------------------------------------

    def contains(self, key: str) -> bool:
        return key in self._index

    def keys(self, prefix: str = "") -> list[str]:
        return self._index.keys(prefix)

    def usage(self) -> TierUsage:
        index = self._index
        with self._mu:
            counters = dict(self._counters)
            held = counters["held_bytes"] = self._held
        with index.lock:  # one consistent snapshot: a commit moves bytes between these
            objects, nbytes, moving = len(index), index.bytes, index.reserved + index.doomed
            counters["effective_capacity"] = index.capacity
        counters["inflight_bytes"] = moving - held
        counters["segments"] = len(self._segments)
        return TierUsage(objects, nbytes, self.capacity, counters)

    def touch(self, key: str) -> None:
        """The memory tier served ``key``: it is recently used here too (no I/O)."""
        if self._index.touch(key):
            self._recency_used(key)

    # -- Tier interface: put ------------------------------------------------------------------

    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool:
        writer = self._writer
        if self._closed or writer is None:
            return False
        direct = self.direct_io and len(data) >= DIRECT_MIN and _diskfile.aligned(data)
        try:
            data, key_bytes, header_len = _diskfile.prepare(
                key, data, meta, align=_diskfile.ALIGN if direct else 0
            )
        except ValueError:
            self._count("declined_invalid")
            return False
        size = record_size(header_len, len(data))
        if size > self.capacity:
            self._count("declined_too_large")
            self._warn("object larger than the disk tier's capacity", size=size, capacity=self.capacity)
            return False
        self._maintain()
        assert self._loop is not None and self._completions is not None
        done: asyncio.Future[bool] = self._loop.create_future()
        record = Append(
            key,
            key_bytes,
            data,
            meta,
            header_len=header_len,
            size=size,
            direct=direct,
            on_done=lambda rec, error: self._written(rec, error, done),
        )
        writer.append(record)
        return await uncancellable(done)

    def _admit(self, record: Append, before_wait: Callable[[], None]) -> bool:
        """On the log writer's placing thread: book the record's space before it is written
        (evicting LRU records, waiting for their space if freeing is behind)."""
        assert self._space is not None
        if self._space.admit(record.size, ADMIT_TIMEOUT_S, before_wait):
            return True
        self._count("declined_no_space")
        self._warn("disk tier: no room came free in time; object not stored", size=record.size)
        record.on_done(record, _Declined())
        return False

    def _written(self, record: Append, error: OSError | None, done: asyncio.Future[bool]) -> None:
        """On a writer thread: index a written record, or give back a failed one's space."""
        segment = record.segment
        if isinstance(error, _Declined):
            self._done(done, False)
            return
        if error is not None or segment is None:
            self._index.cancel(record.size)
            if segment is not None:  # placed: whatever reached the disk must go again
                self._index.hold(record.size)
                self._release(Record(segment.id, record.offset, record.size, 0, 0, 0, record.meta))
            self._write_failed(record, error)
            self._done(done, False)
            return
        rec = Record(
            segment.id,
            record.offset,
            record.size,
            record.header_len,
            len(record.body),
            record.crc,
            record.meta,
        )
        old = self._index.commit(record.key, rec, record.size, doom_old=True)
        assert self._recency is not None
        recency = self._recency.stamp(record.key)
        with self._mu:
            self._counters["puts"] += 1
            self._counters["device_writes"] += 1
            self._counters["device_write_bytes"] += record.size
        assert self._db is not None
        self._db.submit(dbindex.upsert_op(dbindex.row(record.key, rec, recency)))
        if old is not None:
            self._release(old)
        self._done(done, True)

    def _done(self, done: asyncio.Future[bool], ok: bool) -> None:
        assert self._completions is not None
        self._completions.set_result(done, ok)

    def _write_failed(self, record: Append, error: OSError | None) -> None:
        if error is not None and error.errno == errno.ESHUTDOWN:
            return  # closed meanwhile: a declined write, nothing to report
        errno_ = error.errno if error is not None else None
        self._count("out_of_space" if errno_ in (errno.ENOSPC, errno.EDQUOT) else "write_errors")
        if errno_ in (errno.ENOSPC, errno.EDQUOT):
            self._fit_to_filesystem()
        self._warn(
            "disk tier write failed; object not stored", error=str(error), errno=errno_, key=record.key
        )

    def _watermark_moved(self, segment_id: int, safe: int) -> None:
        if self._db is not None:
            self._db.submit(dbindex.watermark_op(segment_id, safe))

    # -- Tier interface: get, delete -----------------------------------------------------

    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None:
        workers = self._workers
        if self._closed or workers is None:
            return None
        rec = self._index.get(key)
        if rec is None:
            self._count("misses")
            return None
        segment = self._segments.acquire(rec.segment)
        if segment is None:
            self._drop(key, rec, "missing")
            return None
        try:
            buf = alloc(rec.body_len)  # may raise NoSpace: nothing to undo but the pin
            if len(buf) != rec.body_len:
                raise ValueError(f"alloc returned {len(buf)} bytes, asked for {rec.body_len}")
            try:
                return await workers.run(self._read, key, rec, segment, buf)
            except TierClosed:
                return None
        finally:
            self._segments.release(segment)

    def _read(self, key: str, rec: Record, segment: Segment, buf: memoryview) -> ObjectMeta | None:
        try:
            bad = read_checked(segment.fd, rec, key, buf)
        except OSError as exc:
            self._count("read_errors")
            self._count("misses")
            self._warn("disk tier read failed; served as a miss", key=key, error=str(exc))
            return None
        if bad is not None:
            self._drop(key, rec, bad)
            return None
        self._count("hits")
        if self._index.get(key) is rec and self._index.touch(key):
            self._recency_used(key)
        return rec.meta

    def _drop(self, key: str, rec: Record, reason: str) -> None:
        """Remove a bad record (if the index still holds this version); always a miss."""
        with self._mu:
            self._counters["misses"] += 1
        if self._index.remove(key, rec) is None:
            return  # replaced or deleted while we read: not corruption
        self._count(reason)
        assert self._db is not None
        self._db.submit(dbindex.delete_op(key))
        self._release(rec)
        self._warn(f"disk tier: {reason} record dropped", key=key)

    async def delete(self, key: str) -> bool:
        """Drop ``key`` from the index at once; its space comes back in the background."""
        if self._closed or self._workers is None:
            return False
        rec = self._index.remove(key)
        if rec is None:
            return False
        self._count("deletes")
        assert self._db is not None
        self._db.submit(dbindex.delete_op(key))
        self._release(rec)
        return True

    # -- space ----------------------------------------------------------------------------

    def _evicted(self, key: str, rec: Record, hold: bool) -> bool:
        """``Space`` evicted ``key``: True if it is held for the next tier (demotion), False
        if its space is to be released."""
        self._count("evictions")
        assert self._db is not None
        self._db.submit(dbindex.delete_op(key))
        victim = self._hold_for_demotion(key, rec) if hold else None
        if victim is None:
            return False
        self.hand_off(victim)
        return True

    def _hold_for_demotion(self, key: str, rec: Record) -> DiskVictim | None:
        if self.on_evict is None:
            return None
        with self._mu:
            if self._held + rec.size > self.effective_capacity // HELD_SHARE:
                self._counters["demotions_dropped"] += 1
                return None
            self._held += rec.size
        segment = self._segments.acquire(rec.segment)
        if segment is None:
            with self._mu:
                self._held -= rec.size
            return None
        return DiskVictim(self, key, rec, segment)

    def victim_corrupt(self) -> None:
        """A held victim failed its check when opened (victim.Holder)."""
        self._count("corrupt")

    def victim_released(self, victim: DiskVictim) -> None:
        """A held victim is done with (demoted, or dropped): give its space back."""
        with self._mu:
            self._held -= victim.record.size
        self._release(victim.record)
        self._segments.release(victim.segment)

    def _release(self, rec: Record) -> None:
        """Give back the space of a record that left the index (doomed there until then)."""
        if self._reclaimer is not None:
            self._reclaimer.release([rec])

    def _maintain(self) -> None:
        """Now and then, from a put: re-read the free space while the capacity is lowered,
        and check that the segment directory still exists."""
        now = time.monotonic()
        assert self._space is not None
        if self._index.capacity < self.capacity and now - self._space.fs_checked >= _SPACE_RECHECK_S:
            self._space.fs_checked = now
            self._submit_quietly(self._fit_to_filesystem)
        if now - self._directory_checked >= _DIRECTORY_CHECK_S:
            self._directory_checked = now
            self._submit_quietly(self._check_directory)

    def _submit_quietly(self, fn: Any) -> None:
        if self._workers is not None:
            with contextlib.suppress(TierClosed):
                self._workers.submit(fn)

    def _check_directory(self) -> None:
        """Segments removed under the running server: drop what they held, start anew."""
        gone = self._segments.forget_missing()
        if not gone and os.path.isdir(self._segment_dir):
            return
        ids = {segment.id for segment in gone}
        lost = [(key, rec) for key, rec in self._index.lru_order() if rec.segment in ids]
        for key, rec in lost:
            if self._index.remove(key, rec, doom=False) is not None:
                self._count("missing")
                assert self._db is not None
                self._db.submit(dbindex.delete_op(key))
        for segment_id in ids:
            assert self._db is not None
            self._db.submit(dbindex.forget_segment_op(segment_id))
        os.makedirs(self._segment_dir, exist_ok=True)
        if self._writer is not None:
            self._writer.roll()
        log.warning(
            "disk tier: segment files were removed under the server; their objects are lost",
            path=str(self.path),
            segments=len(ids),
            objects=len(lost),
        )

    def _make_room(self) -> None:
        """A write ran out of filesystem space (on a writer thread, which retries it): lower
        the effective capacity to what the filesystem holds and evict LRU objects down to
        it (``Space.fit_to_filesystem``)."""
        self._count("out_of_space")
        effective = self._fit_to_filesystem()
        self._warn("disk tier: filesystem full; evicting down to its space", effective_capacity=effective)

    def _fit_to_filesystem(self) -> int:
        assert self._space is not None
        try:
            before, after = self._space.fit_to_filesystem(self.path, self.capacity, dbindex.GROWTH_ROOM)
        except OSError as exc:
            self._warn("disk tier: cannot read the filesystem's free space", error=str(exc))
            return self._index.capacity
        if before < after == self.capacity:
            log.info("disk tier: filesystem has room again", path=str(self.path), capacity=after)
        return after

    # -- recency and small helpers ------------------------------------------------------------

    def _recency_used(self, key: str) -> None:
        if self._recency is not None:
            self._recency.used(key)

    def _flush_recency(self, force: bool = False) -> None:
        if self._recency is not None:
            self._recency.flush(force)

    def _count(self, name: str, n: int = 1) -> None:
        with self._mu:
            self._counters[name] += n

    def _warn(self, event: str, **kw: Any) -> None:
        self._warnings.warning(event, path=str(self.path), **kw)


class _Declined(OSError):
    """A write the tier declined before placing it (no room); already counted."""


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
