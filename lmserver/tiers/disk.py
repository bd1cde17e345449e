"""DiskTier: one crash-safe, self-describing file per object, with a persisted LRU index.

Strategy:

* Files (format in ``_diskfile``) live at ``<root>/objects/<3 hex>/<sha256(key)>``. A put
  writes ``<root>/tmp/<uuid>``, syncs it per the fsync policy, and ``os.rename``\\ s it over
  the final name, so a crash at any moment leaves the old object, the new one, or none:
  never a torn one. Every read checks the body CRC, so even a file torn by a power loss
  under ``fsync="never"`` is dropped (counted ``corrupt``), never served.
* The in-memory index (an ``OrderedDict`` in LRU order plus a ``SortedList`` of keys)
  answers ``contains``, ``keys`` and ``usage`` without I/O. SQLite (``_diskindex``) mirrors
  it for fast restarts; it is written from one background thread, batched, never awaited.
  GET hits update recency in memory and reach SQLite in batches (at most every
  ``recency_flush_s`` seconds or 4096 keys, and at close).
* ``open()``: loads the index from SQLite in LRU order without touching the files. If the
  database is missing or corrupt it is rebuilt from the file headers. If the last run did
  not close cleanly (or ``check_files=True``) the index is reconciled with a listing of the
  object directories: rows whose file is gone are dropped, whole files without a row are
  added back. Rows whose file vanished later are dropped lazily, on the GET that misses.
  A listing cannot tell a row from a newer file of the same size (a crash between a rename
  and its index write): the first GET reads the file's own header, serves the file if its
  body checks, and repairs the row, so an acknowledged put is never a miss after a crash.
* Capacity counts file sizes (header + body) and is never exceeded, including files being
  written and evicted files not yet unlinked: a put first evicts LRU objects (their files
  are unlinked before its own file is written), and declines an object that cannot fit.
* A full filesystem (ENOSPC, EDQUOT) means the configured capacity is more than the real
  space: the tier lowers its *effective* capacity to its own bytes plus the filesystem's
  free space, less a margin (``os.statvfs``), evicts LRU objects down to it and retries the
  write (at most ``_NO_SPACE_RETRIES`` times). While lowered, the free space is re-read at
  most every ``_SPACE_RECHECK_S`` seconds by a put, so the capacity rises again when space
  comes back. ``usage()`` reports both capacities.
* Direct I/O (``direct="auto"``, the default): where the filesystem takes ``O_DIRECT``
  (probed at open), bodies of at least ``DIRECT_MIN`` bytes are written with
  it, their headers padded to a block (format version 2). The body then goes from the
  memory tier's buffer to the device with no page-cache copy: on this 2-vCPU VM that copy
  was the disk tier's main cost and starved the event loop of CPU (4 MiB PUTs streamed
  into ``--disk``: 0.66 -> 2.0 GB/s, EXIST p50 on the same socket 7.7 -> 1.6 ms). It also
  keeps a second copy of what memory already holds out of the page cache. Reads stay
  buffered. A write the filesystem refuses (EINVAL) turns direct I/O off for the tier,
  with a warning, and is retried buffered.
* All blocking work (file I/O, fsync, SQLite) runs in threads: a bounded pool for object
  I/O, one thread for SQLite, one for ``fsync="batch"`` group commits. State is guarded by
  a lock, and per-key stripe locks order the renames/unlinks of one key against index
  updates, so concurrent puts of one key leave exactly the last renamed version, indexed.

fsync policies (``fsync=``):

* ``"always"``: fsync the file before the rename and the directory after it; a put returns
  once the object is durable.
* ``"batch"``: group commit of the names. Each writer fsyncs its own temp file (data
  fsyncs overlap across the pool's threads), then queues it; a batch closes
  ``batch_window_s`` (default 10 ms) after its first object, at ``batch_bytes`` (default
  64 MiB), or as soon as no other put is still writing, whichever is first. The sync
  thread renames the batch's files, fsyncs each directory touched once (concurrently),
  and only then completes the puts: a put returns durable, after at most one window plus
  one round of directory fsyncs. Measured here it is no faster than ``always`` (this
  disk's fsyncs are cheap and the filesystem already merges concurrent ones); it pays off
  where each journal commit is slow. (``syncfs`` per batch was tried and dropped: it also
  waits for every other writer's dirty data on the filesystem; on this shared machine a
  batch then took over 0.5 s.)
* ``"never"`` (the default): no fsync. An acknowledged object survives a process crash
  (the page cache holds it) but maybe not a power loss; whatever a power loss tears is
  caught by the checksums and dropped. This is a cache: every object can be recomputed,
  a miss costs a recompute while an fsync per put caps throughput, and a hit is never
  wrong under any policy. Pick ``batch``/``always`` when PUT_ACK must mean "on disk".
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import fcntl
import mmap
import os
import sqlite3
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal, NamedTuple

import structlog
from sortedcontainers import SortedList

from lmproto import ObjectMeta

from ..logs import ThrottledWarnings
from . import _diskfile, _diskindex
from .base import COMMON_COUNTERS, Alloc, ConfigError, Tier, TierError, TierUsage, Victim
from .spec import Mode, TierSpec
from .threaded import uncancellable

log = structlog.get_logger(__name__)

FsyncPolicy = Literal["always", "batch", "never"]
FSYNC_POLICIES: tuple[FsyncPolicy, ...] = ("always", "batch", "never")
DEFAULT_FSYNC: FsyncPolicy = "never"
DEFAULT_CAPACITY = 64 * 1024**3
DirectPolicy = Literal["auto", "off"]
DIRECT_POLICIES: tuple[DirectPolicy, ...] = ("auto", "off")
DIRECT_MIN = 64 * 1024
"""Smaller bodies are written through the page cache: their copy is cheap, and a direct
write of a few blocks waits for the device."""
HELD_SHARE = 8
"""Evicted files waiting for demotion may hold at most 1/HELD_SHARE of the capacity."""

_STRIPES = 64
_TOUCH_BATCH = 4096
_PROGRESS_EVERY = 10_000
_REBUILD_CHUNK = 256
_WARN_INTERVAL_S = 10.0
_NO_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_RETRIES = 3
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_SPACE_RECHECK_S = 1.0


class _Entry(NamedTuple):
    """One indexed object. Compared by identity: a newer version is a new _Entry."""

    name: str
    size: int
    header_len: int
    body_len: int
    crc: int
    meta: ObjectMeta


class _Job(NamedTuple):
    """A written temp file waiting to be renamed into place."""

    key: str
    tmp: str
    final: str
    entry: _Entry
    future: concurrent.futures.Future[bool]


def _row(key: str, e: _Entry, recency: int) -> _diskindex.Row:
    m = e.meta
    s0, s1, s2, s3 = m.shape
    return (
        key,
        e.name,
        e.size,
        e.header_len,
        e.body_len,
        e.crc,
        m.fmt,
        m.dtype,
        s0,
        s1,
        s2,
        s3,
        m.location,
        recency,
    )


def _entry_from_header(name: str, h: _diskfile.Header) -> _Entry:
    return _Entry(name, h.size, h.header_len, h.body_len, h.body_crc, h.meta)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_quietly(path: str) -> OSError | None:
    try:
        _fsync_path(path)
    except OSError as exc:
        return exc
    return None


class DiskTier(Tier):
    """A capacity-bounded LRU object store on a local filesystem. See the module docstring.

    Lifecycle: ``tier = DiskTier(path, capacity=...)``, ``await tier.open()`` once, then use
    from any thread or event loop, then ``await tier.close()``. ``put`` reads ``data`` until
    it returns; ``get_into`` calls ``alloc`` on the calling thread (before any I/O) and
    writes into the buffer until it returns; neither returns early, even when cancelled.

    Evicted files are moved aside (``<root>/evicted/``) and handed off for demotion when a
    tier stands behind this one; they count against capacity until released.
    """

    default_mode: Mode = "write-behind"

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DiskTier:
        """``disk:PATH?capacity=64GiB&fsync=never&workers=4&direct=auto``."""
        if not spec.target:
            raise ConfigError(f"tier {spec}: a disk tier needs a directory (disk:/path)")
        return cls(
            spec.target,
            capacity=spec.size("capacity", DEFAULT_CAPACITY),
            fsync=spec.choice("fsync", FSYNC_POLICIES, DEFAULT_FSYNC),
            max_workers=spec.integer("workers", 4, minimum=1),
            direct=spec.choice("direct", DIRECT_POLICIES, "auto"),
            name=spec.string("name", "disk"),
        )

    def __init__(
        self,
        path: Path | str,
        *,
        capacity: int,
        fsync: FsyncPolicy = DEFAULT_FSYNC,
        max_workers: int = 4,
        batch_window_s: float = 0.010,
        batch_bytes: int = 64 << 20,
        check_files: bool | None = None,
        recency_flush_s: float = 1.0,
        direct: DirectPolicy = "auto",
        name: str = "disk",
    ) -> None:
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, not {fsync!r}")
        if direct not in DIRECT_POLICIES:
            raise ValueError(f"direct must be one of {DIRECT_POLICIES}, not {direct!r}")
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.name = name
        self.path = Path(path)
        self.capacity = capacity  # as configured
        self.effective_capacity = capacity  # lower while the filesystem holds less
        self.fsync: FsyncPolicy = fsync
        self.check_files = check_files
        self.direct = direct
        self.direct_io = False  # whether O_DIRECT writes are in use (probed at open)
        self._max_workers = max_workers
        self._batch_window_s = batch_window_s
        self._batch_bytes = batch_bytes
        self._recency_flush_s = recency_flush_s
        self._objects = str(self.path / "objects")
        self._tmp = str(self.path / "tmp")
        self._evicted = str(self.path / "evicted")
        self._db_path = self.path / "index.sqlite3"

        # Index state, guarded by _mu.
        self._mu = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._sorted: SortedList = SortedList()
        self._bytes = 0  # indexed objects
        self._reserved = 0  # files being written
        self._doomed = 0  # files dropped from the index, not yet unlinked
        self._held = 0  # evicted files handed off for demotion, not yet released
        self._clock = 0  # recency counter, persisted per row
        self._touches: dict[str, int] = {}
        self._touches_since = time.monotonic()
        self._space_checked = 0.0  # when the free space was last read (monotonic)
        self._counters = dict.fromkeys(
            (
                *COMMON_COUNTERS,
                "write_errors",
                "out_of_space",
                "read_errors",
                "declined_too_large",
                "declined_no_space",
                "declined_invalid",
                "index_repairs",
                "demotions_dropped",
            ),
            0,
        )
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._room_lock = threading.Lock()  # one writer at a time makes room on a full filesystem
        self._warnings = ThrottledWarnings(log, _WARN_INTERVAL_S)

        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._db: _diskindex.IndexWriter | None = None
        self._syncer: _BatchSyncer | None = None
        self._lock_fd: int | None = None
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._pool is not None:
            raise RuntimeError("DiskTier.open() called twice")
        self._pool = concurrent.futures.ThreadPoolExecutor(
            self._max_workers, thread_name_prefix="lmserver-disk"
        )
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self._open_sync)
        except BaseException as exc:
            self._closed = True
            self._pool.shutdown(wait=False)
            self._release_lock()
            if self._filesystem_full(exc):  # an operator's problem, not a bug: say so plainly
                raise OSError(errno.ENOSPC, f"disk tier {self.path}: the filesystem is full ({exc})") from exc
            raise

    async def close(self) -> None:
        """Finish in-flight work, flush recency and the index, mark the index clean."""
        if self._closed or self._pool is None:
            self._closed = True
            return
        self._closed = True
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        assert self._pool is not None
        self._pool.shutdown(wait=True)  # every put has queued its batch job by now
        if self._syncer is not None:
            self._syncer.close()
        if self._db is not None:
            self._flush_touches(force=True)
            if self._db.errors == 0:
                self._db.submit(_diskindex.set_meta_op("clean", "1"))
            self._db.close()
        self._release_lock()
        with self._mu:
            objects, nbytes = len(self._entries), self._bytes
        log.info("disk tier closed", path=str(self.path), objects=objects, bytes=nbytes)

    def _filesystem_full(self, exc: BaseException) -> bool:
        """Did SQLite fail for want of space? (A full disk can also surface as an I/O error,
        e.g. SQLITE_IOERR_SHMSIZE when the WAL index cannot grow.)"""
        if not isinstance(exc, sqlite3.OperationalError):
            return False
        code = getattr(exc, "sqlite_errorcode", 0)
        if code == sqlite3.SQLITE_FULL:
            return True
        try:
            st = os.statvfs(self.path)
        except OSError:
            return False
        return code & 0xFF == sqlite3.SQLITE_IOERR and st.f_bavail * st.f_frsize < (1 << 20)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def _open_sync(self) -> None:
        started = time.monotonic()
        self.path.mkdir(parents=True, exist_ok=True)
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"disk tier directory {self.path} is in use by another process") from None
        self._make_dirs()
        removed_tmp = self._clean_tmp()
        self.direct_io = self.direct == "auto" and _diskfile.direct_io_works(self._tmp)

        conn, source = self._load_or_rebuild()
        try:
            reconciled = False
            if source == "index" and (
                self.check_files or (self.check_files is None and _diskindex.get_meta(conn, "clean") != "1")
            ):
                self._reconcile(conn)
                reconciled = True
            self._enforce_capacity(conn)
            _diskindex.set_meta_durably(conn, "clean", "0")
        except BaseException:
            conn.close()
            raise
        self._db = _diskindex.IndexWriter(conn, idle_s=self._recency_flush_s, on_idle=self._flush_touches)
        if self.fsync == "batch":
            self._syncer = _BatchSyncer(self, self._batch_window_s, self._batch_bytes)
        log.info(
            "disk tier opened",
            path=str(self.path),
            objects=len(self._entries),
            bytes=self._bytes,
            capacity=self.capacity,
            fsync=self.fsync,
            direct_io=self.direct_io,
            index=source,
            reconciled=reconciled,
            temp_files_removed=removed_tmp,
            seconds=round(time.monotonic() - started, 3),
        )

    def _make_dirs(self) -> None:
        created = False
        for d in (self._objects, self._tmp, self._evicted):
            if not os.path.isdir(d):
                os.makedirs(d, exist_ok=True)
                created = True
        if created:  # make the new directories themselves durable, once
            _fsync_path(str(self.path))

    def _clean_tmp(self) -> int:
        """Remove partial writes and evicted files whose demotion a crash interrupted."""
        removed = 0
        for folder in (self._tmp, self._evicted):
            with os.scandir(folder) as it:
                for de in it:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(de.path)
                        removed += 1
        return removed

    def _load_or_rebuild(self) -> tuple[sqlite3.Connection, str]:
        existed = self._db_path.exists()
        if existed:
            conn: sqlite3.Connection | None = None
            try:
                conn = _diskindex.connect(self._db_path)
                schema = _diskindex.get_meta(conn, "schema")
                if schema == _diskindex.SCHEMA_VERSION:
                    self._load_rows(conn)
                    return conn, "index"
                log.warning("disk index has an unknown schema; rebuilding from files", schema=schema)
            except sqlite3.DatabaseError as exc:
                if self._filesystem_full(exc):  # not corrupt: keep it, and fail the open
                    if conn is not None:
                        conn.close()
                    raise
                log.warning("disk index is unreadable; rebuilding from files", error=str(exc))
            if conn is not None:
                conn.close()
            self._entries.clear()
            self._sorted.clear()
            self._bytes = self._clock = 0
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._db_path, self._db_path.with_name(self._db_path.name + ".corrupt"))
        for suffix in ("-wal", "-shm"):  # never let a stale WAL meet a new database
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._db_path.with_name(self._db_path.name + suffix))
        conn = _diskindex.connect(self._db_path)
        try:
            found = self._rebuild(conn, announce=existed)
            _diskindex.set_meta(conn, "schema", _diskindex.SCHEMA_VERSION)
        except BaseException:
            conn.close()
            raise
        return conn, "rebuilt" if existed or found else "new"

    def _load_rows(self, conn: sqlite3.Connection) -> None:
        entries = self._entries
        metas: dict[tuple[int, ...], ObjectMeta] = {}  # objects of one model share metadata
        make = tuple.__new__
        total = recency = 0
        rows = _diskindex.load_rows(conn)
        for key, name, size, header_len, body_len, crc, f, d, s0, s1, s2, s3, loc, recency in rows:  # noqa: B007
            mkey = (f, d, s0, s1, s2, s3, loc)
            meta = metas.get(mkey)
            if meta is None:
                meta = metas.setdefault(mkey, ObjectMeta(f, d, (s0, s1, s2, s3), loc))
            entries[key] = make(_Entry, (name, size, header_len, body_len, crc, meta))
            total += size
        self._sorted = SortedList(entries)
        self._bytes = total
        self._clock = recency

    def _scan_files(self) -> Iterable[os.DirEntry[str]]:
        """Every file in the fan-out directories."""
        with os.scandir(self._objects) as top:
            subdirs = [de.path for de in top if de.is_dir(follow_symlinks=False)]
        for sub in subdirs:
            with os.scandir(sub) as it:
                yield from it

    def _read_orphan(self, name: str, path: str) -> tuple[str, _diskfile.Header] | None:
        """Header of a whole object file, or None (after deleting it) for anything else."""
        try:
            header, _size = _diskfile.read_header_at(path)
            if _diskfile.object_name(header.key.encode()) != name or not name.startswith(
                os.path.basename(os.path.dirname(path))
            ):
                raise _diskfile.CorruptFile("file name does not match its key")
        except (_diskfile.CorruptFile, OSError) as exc:
            log.warning("disk tier: removing an invalid object file", file=name, error=str(exc))
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        return header.key, header

    def _read_orphans(self, chunk: list[tuple[str, str]]) -> list[tuple[str, _diskfile.Header] | None]:
        return [self._read_orphan(name, path) for name, path in chunk]

    def _rebuild(self, conn: sqlite3.Connection, *, announce: bool) -> int:
        """Index every whole object file, least recently written first; returns how many."""
        started = time.monotonic()
        files = [(de.name, de.path) for de in self._scan_files()]
        chunks = [files[i : i + _REBUILD_CHUNK] for i in range(0, len(files), _REBUILD_CHUNK)]
        found: list[tuple[int, str, str, _diskfile.Header]] = []
        scanned = 0
        # Header reads are small random reads: several in flight fill a cold disk's queue.
        with concurrent.futures.ThreadPoolExecutor(2 * self._max_workers) as readers:
            for chunk, results in zip(chunks, readers.map(self._read_orphans, chunks), strict=True):
                for (name, _path), got in zip(chunk, results, strict=True):
                    if got is not None:
                        found.append((got[1].written_ns, got[0], name, got[1]))
                before, scanned = scanned, scanned + len(chunk)
                if scanned // _PROGRESS_EVERY != before // _PROGRESS_EVERY:
                    log.info("disk index rebuild in progress", files=scanned, total=len(files))
        found.sort(key=lambda t: t[0])
        rows = []
        for recency, (_ns, key, name, header) in enumerate(found, 1):
            entry = _entry_from_header(name, header)
            self._entries[key] = entry
            self._bytes += entry.size
            rows.append(_row(key, entry, recency))
        self._clock = len(found)
        self._sorted = SortedList(self._entries)
        _diskindex.apply_changes(conn, rows=rows)
        if announce or found:
            log.info(
                "disk index rebuilt from files",
                files=scanned,
                objects=len(found),
                seconds=round(time.monotonic() - started, 3),
            )
        return len(found)

    def _reconcile(self, conn: sqlite3.Connection) -> None:
        """Match the index against a listing of the files (after an unclean shutdown).

        Rows without a file are dropped; files without a row, or whose size differs from
        their row (a newer version renamed in just before the crash), are indexed from
        their headers. A same-size stale row is repaired lazily by the GET that meets it
        (which serves the newer file), so a restart reads no headers for known files.
        """
        by_name = {e.name: k for k, e in self._entries.items()}
        on_disk: set[str] = set()
        orphans: list[tuple[int, str, str, _diskfile.Header]] = []
        for de in self._scan_files():
            name = de.name
            key = by_name.get(name)
            if key is not None:
                on_disk.add(name)
                if de.stat(follow_symlinks=False).st_size == self._entries[key].size:
                    continue
            got = self._read_orphan(name, de.path)
            if got is not None:
                orphans.append((got[1].written_ns, got[0], name, got[1]))
            elif key is not None:
                on_disk.discard(name)
        gone = [k for n, k in by_name.items() if n not in on_disk]
        for key in gone:
            self._bytes -= self._entries.pop(key).size
            self._sorted.remove(key)
        rows = []
        for _ns, key, name, header in sorted(orphans, key=lambda t: t[0]):
            entry = _entry_from_header(name, header)
            old = self._entries.pop(key, None)  # a stale row for this very file
            if old is not None:
                self._bytes -= old.size
            else:
                self._sorted.add(key)
            self._entries[key] = entry
            self._bytes += entry.size
            self._clock += 1
            rows.append(_row(key, entry, self._clock))
        self._counters["missing"] += len(gone)
        _diskindex.apply_changes(conn, deletes=gone, rows=rows)
        if gone or orphans:
            log.info("disk index reconciled with files", rows_dropped=len(gone), files_added=len(orphans))

    def _enforce_capacity(self, conn: sqlite3.Connection) -> None:
        victims = []
        while self._bytes > self.capacity and self._entries:
            key, entry = self._entries.popitem(last=False)
            self._sorted.remove(key)
            self._bytes -= entry.size
            victims.append(key)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path_of(entry.name))
        if victims:
            self._counters["evictions"] += len(victims)
            _diskindex.apply_changes(conn, deletes=victims)
            log.info("disk tier over capacity at open: evicted", objects=len(victims))

    async def sync_index(self) -> None:
        """Wait until SQLite holds every index change made so far (recency excepted)."""
        if self._db is not None and not self._closed:
            await asyncio.wrap_future(self._db.flush())

    # -- Tier interface ----------------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return key in self._entries  # one atomic dict lookup

    def keys(self, prefix: str = "") -> list[str]:
        with self._mu:
            if not prefix:
                return list(self._sorted)
            out = []
            for k in self._sorted.irange(minimum=prefix):
                if not k.startswith(prefix):
                    break
                out.append(k)
            return out

    def usage(self) -> TierUsage:
        with self._mu:
            counters = dict(self._counters)
            counters["inflight_bytes"] = self._reserved + self._doomed
            counters["held_bytes"] = self._held
            counters["effective_capacity"] = self.effective_capacity
            return TierUsage(len(self._entries), self._bytes, self.capacity, counters)

    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool:
        if self._closed or self._pool is None:
            return False
        direct = self.direct_io and len(data) >= DIRECT_MIN and _diskfile.aligned(data)
        try:
            data, key_bytes, header_len = _diskfile.prepare(
                key, data, meta, align=_diskfile.ALIGN if direct else 0
            )
        except ValueError:
            self._count("declined_invalid")
            return False
        size = header_len + len(data)
        if size > self.capacity:
            self._count("declined_too_large")
            self._warn("object larger than the disk tier's capacity", size=size, capacity=self.capacity)
            return False
        plan = self._reserve(size)
        if plan is None:
            self._count("declined_no_space")
            self._warn("disk tier full of in-flight writes (or its filesystem); object not stored", size=size)
            return False
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(
                self._pool, self._put_sync, key, key_bytes, data, meta, size, plan, header_len
            )
        except RuntimeError:  # closed meanwhile
            self._release_plan(size, plan)
            return False
        result = await uncancellable(fut)
        if isinstance(result, bool):
            return result
        # fsync="batch": the file is written (``data`` is no longer read); wait for the
        # group commit, which happens even if this caller is cancelled.
        return await asyncio.shield(asyncio.wrap_future(result))

    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None:
        if self._closed or self._pool is None:
            return None
        with self._mu:
            entry = self._entries.get(key)
            if entry is None:
                self._counters["misses"] += 1
                return None
        buf = alloc(entry.body_len)  # may raise NoSpace: nothing to undo
        if len(buf) != entry.body_len:
            raise ValueError(f"alloc returned {len(buf)} bytes, asked for {entry.body_len}")
        loop = asyncio.get_running_loop()
        try:
            fut = loop.run_in_executor(self._pool, self._get_sync, key, entry, buf)
        except RuntimeError:  # closed meanwhile
            return None
        return await uncancellable(fut)

    async def delete(self, key: str) -> bool:
        if self._closed or self._pool is None:
            return False
        if key not in self._entries:
            return False
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, self._delete_sync, key)
        except RuntimeError:
            return False
        return await fut

    # -- internals: capacity -----------------------------------------------------------------

    def _reserve(self, size: int) -> tuple[int, list[tuple[str, _Entry]]] | None:
        """Make room for ``size`` bytes: returns (bytes reserved now, victims) or None.

        Invariant: bytes + reserved + doomed <= capacity and >= what is on disk. Victims
        move from ``bytes`` to ``doomed`` (still on disk); the put unlinks them before it
        writes, then converts their share into its reservation (``_victims_gone``). Files
        held for demotion count too; when the total is over (held files, or an effective
        capacity lowered by a full filesystem) the victims also cover the excess, so the
        invariant holds again once they are gone.
        """
        with self._mu:
            if self._reserved + self._doomed + size > self.effective_capacity:
                return None
            victims: list[tuple[str, _Entry]] = []
            mine = 0
            # Room for this object now (victims not yet unlinked still take space), and no
            # excess once every doomed file is gone: held files count, and the capacity may
            # have been lowered. The excess leaves out other puts' victims, so concurrent
            # puts do not each evict the same excess again.
            while self._entries and (
                (
                    mine < size
                    and self._bytes + self._reserved + self._doomed + self._held + size - mine
                    > self.effective_capacity
                )
                or self._bytes + self._reserved + self._held + size > self.effective_capacity
            ):
                key, entry = self._entries.popitem(last=False)
                self._sorted.remove(key)
                self._touches.pop(key, None)
                self._bytes -= entry.size
                self._doomed += entry.size
                mine += entry.size
                victims.append((key, entry))
            pre = max(0, size - mine)
            self._reserved += pre
            if victims:
                self._counters["evictions"] += len(victims)
                assert self._db is not None
                self._db.submit(_diskindex.delete_many_op([k for k, _ in victims]))
            return pre, victims

    def _victims_gone(self, size: int, plan: tuple[int, list[tuple[str, _Entry]]], hold: bool = True) -> None:
        pre, victims = plan
        handed: list[_DiskVictim] = []
        for key, entry in victims:
            with self._stripe(key):
                # A put of the same key may have renamed a new file over it meanwhile.
                if key in self._entries:
                    continue
                victim = self._set_aside(key, entry) if hold else None
                if victim is None and self.on_evict is not None:
                    self._count("demotions_dropped")
                if victim is None:
                    self._unlink(self._path_of(entry.name))
                else:
                    handed.append(victim)
        mine = sum(e.size for _, e in victims)
        with self._mu:
            self._doomed -= mine
            self._reserved += size - pre
        for victim in handed:
            self.hand_off(victim)

    def _set_aside(self, key: str, entry: _Entry) -> _DiskVictim | None:
        """Move an evicted file out of its key's path (a new version may be written there)
        and keep it, counted as held, until the Store has demoted it. Only while a taker
        exists and what is held stays within HELD_SHARE of the capacity: the check and the
        booking happen under one lock, so concurrent puts cannot overshoot the share."""
        with self._mu:
            if self.on_evict is None or self._held + entry.size > self.effective_capacity // HELD_SHARE:
                return None
            self._held += entry.size
        held = os.path.join(self._evicted, uuid.uuid4().hex)
        try:
            os.rename(self._path_of(entry.name), held)
        except OSError as exc:
            with self._mu:
                self._held -= entry.size
            if not isinstance(exc, FileNotFoundError):
                self._warn("disk tier: could not set an evicted file aside", error=str(exc))
            return None
        return _DiskVictim(self, key, entry, held)

    def _victim_released(self, size: int) -> None:
        with self._mu:
            self._held -= size

    def _release_plan(self, size: int, plan: tuple[int, list[tuple[str, _Entry]]]) -> None:
        self._victims_gone(size, plan)
        with self._mu:
            self._reserved -= size

    # -- internals: the worker-thread side --------------------------------------------------

    def _put_sync(
        self,
        key: str,
        key_bytes: bytes,
        data: memoryview,
        meta: ObjectMeta,
        size: int,
        plan: tuple[int, list[tuple[str, _Entry]]],
        header_len: int,
    ) -> bool | concurrent.futures.Future[bool]:
        syncer = self._syncer
        job: _Job | None = None
        if syncer is not None:
            syncer.writer_started()
        try:
            job = self._write_temp(key, key_bytes, data, meta, size, plan, header_len)
        finally:
            if syncer is not None:
                syncer.writer_done(job)
        if job is None:
            return False
        if syncer is not None:
            return job.future
        if not self._commit(job):
            return False
        if self.fsync == "always":
            try:
                _fsync_path(os.path.dirname(job.final))
            except OSError as exc:
                self._count("write_errors")
                self._warn("disk tier: directory fsync failed", error=str(exc))
                return False
        return True

    def _write_temp(
        self,
        key: str,
        key_bytes: bytes,
        data: memoryview,
        meta: ObjectMeta,
        size: int,
        plan: tuple[int, list[tuple[str, _Entry]]],
        header_len: int,
    ) -> _Job | None:
        """Evict the planned victims, then write the object to a temp file (directly, if
        put() padded its header for that)."""
        self._victims_gone(size, plan)
        name = _diskfile.object_name(key_bytes)
        crc = _diskfile.checksum(data)
        direct = header_len != _diskfile.header_size(key_bytes)
        align = _diskfile.ALIGN if direct else 0
        try:
            header = _diskfile.encode_header(key_bytes, len(data), crc, meta, time.time_ns(), align=align)
        except ValueError:
            with self._mu:
                self._reserved -= size
                self._counters["declined_invalid"] += 1
            return None
        self._recheck_space()
        attempt = 0
        while True:
            tmp = os.path.join(self._tmp, uuid.uuid4().hex)
            fd = -1
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (_O_DIRECT if direct else 0)
            try:
                fd = os.open(tmp, flags, 0o644)
                _diskfile.write_object(fd, header, data, direct=direct)
                if self.fsync != "never":
                    os.fsync(fd)
                os.close(fd)
                break
            except OSError as exc:
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
                if exc.errno in _NO_SPACE_ERRNOS and attempt < _NO_SPACE_RETRIES:
                    attempt += 1
                    self._make_room(tmp)
                    continue
                if direct and exc.errno == errno.EINVAL:
                    # The filesystem took the probe but not this write: buffered from now on
                    # (the padded header is still a valid file).
                    direct = False
                    self._direct_refused(tmp, exc)
                    continue
                self._write_failed(tmp, size, exc, key=key)
                return None
        entry = _Entry(name, size, len(header), len(data), crc, meta)
        return _Job(key, tmp, self._path_of(name), entry, concurrent.futures.Future())

    def _commit(self, job: _Job) -> bool:
        """Rename a written temp file into place and index it, atomically per key."""
        with self._stripe(job.key):
            try:
                self._rename_into_place(job.tmp, job.final)
            except OSError as exc:
                self._write_failed(job.tmp, job.entry.size, exc, key=job.key)
                return False
            with self._mu:
                self._reserved -= job.entry.size
                old = self._entries.pop(job.key, None)
                if old is None:
                    self._sorted.add(job.key)
                else:
                    self._bytes -= old.size
                self._entries[job.key] = job.entry
                self._bytes += job.entry.size
                self._clock += 1
                self._touches.pop(job.key, None)
                self._counters["puts"] += 1
                assert self._db is not None
                self._db.submit(_diskindex.upsert_op(_row(job.key, job.entry, self._clock)))
        return True

    def _rename_into_place(self, tmp: str, final: str) -> None:
        try:
            os.rename(tmp, final)
        except FileNotFoundError:
            # First object of its fan-out directory: create it (durably unless "never").
            with contextlib.suppress(FileExistsError):  # a racing put may have made it
                os.mkdir(os.path.dirname(final))
            if self.fsync != "never":
                _fsync_path(self._objects)
            os.rename(tmp, final)

    def _direct_refused(self, tmp: str, exc: OSError) -> None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if self.direct_io:
            self.direct_io = False
            log.warning(
                "disk tier: direct I/O refused; writing through the page cache",
                path=str(self.path),
                error=str(exc),
            )

    def _write_failed(self, tmp: str, size: int, exc: OSError, **kw: Any) -> None:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        with self._mu:
            self._reserved -= size
            self._counters["write_errors"] += 1
        if exc.errno in _NO_SPACE_ERRNOS:  # (a rename or mkdir): fit the next puts
            self._fit_to_filesystem()
        self._warn("disk tier write failed; object not stored", error=str(exc), errno=exc.errno, **kw)

    def _make_room(self, tmp: str) -> None:
        """A write ran out of filesystem space (the put keeps its reservation): lower the
        effective capacity to what the filesystem holds and evict LRU objects down to it.
        One writer at a time, victims unlinked before the next looks: writers that ran out
        together then evict once, not once each (victims count as on disk until unlinked),
        and retry into the space already freed."""
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # its blocks count as free below
        self._count("out_of_space")
        with self._room_lock:
            effective = self._fit_to_filesystem()
            plan = self._reserve(0)
            if plan is not None:  # (None: in-flight writes alone fill it for now; retry anyway)
                self._victims_gone(0, plan, hold=False)  # set aside, they would free nothing
        self._warn("disk tier: filesystem full; evicting down to its space", effective_capacity=effective)

    def _fit_to_filesystem(self) -> int:
        """Effective capacity = our files + the filesystem's free space - a margin (room for
        the index to grow, plus 1/64 of the filesystem, at most 1 GiB, for directories and
        block rounding), never above the configured capacity. Returns it."""
        try:
            st = os.statvfs(self.path)
        except OSError as exc:
            self._warn("disk tier: cannot read the filesystem's free space", error=str(exc))
            return self.effective_capacity
        margin = _diskindex.GROWTH_ROOM + min(max(st.f_blocks * st.f_frsize // 64, 16 * st.f_frsize), 1 << 30)
        with self._mu:
            self._space_checked = time.monotonic()
            before = self.effective_capacity
            fits = self._bytes + self._doomed + self._held + st.f_bavail * st.f_frsize - margin
            self.effective_capacity = after = max(0, min(self.capacity, fits))
        if before < after == self.capacity:
            log.info("disk tier: filesystem has room again", path=str(self.path), capacity=after)
        return after

    def _recheck_space(self) -> None:
        """While the effective capacity is lowered, re-read the free space now and then."""
        if (
            self.effective_capacity < self.capacity
            and time.monotonic() - self._space_checked >= _SPACE_RECHECK_S
        ):
            self._fit_to_filesystem()

    def _get_sync(self, key: str, entry: _Entry, buf: memoryview) -> ObjectMeta | None:
        path = self._path_of(entry.name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._drop(key, entry, "missing")
            return None
        except OSError as exc:
            self._read_failed(key, exc)
            return None
        try:
            size = os.fstat(fd).st_size
            header = bytearray(entry.header_len)
            got = _diskfile.read_object(fd, header, buf)
        except OSError as exc:
            self._read_failed(key, exc)
            return None
        finally:
            os.close(fd)
        try:
            h = _diskfile.decode_header(header)
        except _diskfile.CorruptFile:
            self._drop(key, entry, "corrupt")
            return None
        if h.key != key:
            self._drop(key, entry, "corrupt")
            return None
        if (h.body_len, h.body_crc, h.meta) != (entry.body_len, entry.crc, entry.meta):
            if size != h.size:
                self._drop(key, entry, "corrupt")
                return None
            # A whole file of another version: the index is stale (or the key was just
            # overwritten). Same length: the buffer holds its body; serve it if it checks.
            whole = h.body_len == entry.body_len and got == size and _diskfile.checksum(buf) == h.body_crc
            return self._repair(key, entry, h, whole)
        if size != entry.size or got != entry.size or _diskfile.checksum(buf) != entry.crc:
            self._drop(key, entry, "corrupt")
            return None
        with self._mu:
            self._counters["hits"] += 1
            if self._entries.get(key) is entry:
                self._note_use_locked(key)
        self._flush_touches()
        return entry.meta

    def touch(self, key: str) -> None:
        """The memory tier served ``key``: it is recently used here too (no I/O)."""
        with self._mu:
            if key in self._entries:
                self._note_use_locked(key)
        self._flush_touches()

    def _note_use_locked(self, key: str) -> None:
        self._entries.move_to_end(key)
        self._clock += 1
        self._touches[key] = self._clock

    def _repair(self, key: str, entry: _Entry, header: _diskfile.Header, whole: bool) -> ObjectMeta | None:
        """Re-index a file whose header disagrees with a stale row; serve it if ``whole``
        (its body, read into the caller's buffer, matched the header's CRC), else a miss.

        Happens after a crash between a rename and its index write: a reconcile at open
        trusts a row whose file has the same size, and the file is the newer, acknowledged
        version (or a concurrent overwrite, which the identity check tells apart: it is
        served, the index already has it). A body that does not check is read next time.
        """
        with self._stripe(key), self._mu:
            self._counters["hits" if whole else "misses"] += 1
            if self._entries.get(key) is entry:
                fixed = _entry_from_header(entry.name, header)
                self._entries[key] = fixed
                self._entries.move_to_end(key)
                self._bytes += fixed.size - entry.size
                self._clock += 1
                self._touches.pop(key, None)
                self._counters["index_repairs"] += 1
                assert self._db is not None
                self._db.submit(_diskindex.upsert_op(_row(key, fixed, self._clock)))
        return header.meta if whole else None

    def _read_failed(self, key: str, exc: OSError) -> None:
        with self._mu:
            self._counters["read_errors"] += 1
            self._counters["misses"] += 1
        self._warn("disk tier read failed; served as a miss", key=key, error=str(exc))

    def _drop(self, key: str, entry: _Entry, reason: Literal["corrupt", "missing"]) -> None:
        """Remove a bad object (if the index still holds this version); always a miss."""
        with self._stripe(key):
            with self._mu:
                self._counters["misses"] += 1
                if self._entries.get(key) is not entry:
                    return  # replaced or deleted while we read: not corruption
                del self._entries[key]
                self._sorted.remove(key)
                self._touches.pop(key, None)
                self._bytes -= entry.size
                self._counters[reason] += 1
                assert self._db is not None
                self._db.submit(_diskindex.delete_op(key))
                if reason == "corrupt":
                    self._doomed += entry.size
            if reason == "corrupt":
                self._unlink(self._path_of(entry.name))
                with self._mu:
                    self._doomed -= entry.size
        self._warn(f"disk tier: {reason} object file dropped", key=key)

    def _delete_sync(self, key: str) -> bool:
        with self._stripe(key):
            with self._mu:
                entry = self._entries.pop(key, None)
                if entry is None:
                    return False
                self._sorted.remove(key)
                self._touches.pop(key, None)
                self._bytes -= entry.size
                self._doomed += entry.size
                self._counters["deletes"] += 1
                assert self._db is not None
                self._db.submit(_diskindex.delete_op(key))
            self._unlink(self._path_of(entry.name))
            with self._mu:
                self._doomed -= entry.size
        return True

    def _flush_touches(self, force: bool = False) -> None:
        """Hand batched recency updates to the index writer (any thread)."""
        with self._mu:
            if not self._touches:
                self._touches_since = time.monotonic()
                return
            if (
                not force
                and len(self._touches) < _TOUCH_BATCH
                and time.monotonic() - self._touches_since < self._recency_flush_s
            ):
                return
            touches, self._touches = self._touches, {}
            self._touches_since = time.monotonic()
            assert self._db is not None
            self._db.submit(_diskindex.touch_op(touches))

    # -- internals: batch sync ---------------------------------------------------------------

    def _sync_batch(self, jobs: list[_Job], fsyncs: concurrent.futures.ThreadPoolExecutor) -> None:
        """Run by the sync thread: the files are durable (their writers fsynced them);
        rename them, then make the names durable with one fsync per directory touched."""
        committed: list[_Job] = []
        for job in jobs:
            if self._commit(job):
                committed.append(job)
            else:
                job.future.set_result(False)
        dirs = sorted({os.path.dirname(job.final) for job in committed})
        failed_dirs = {d for d, err in zip(dirs, fsyncs.map(_fsync_quietly, dirs), strict=True) if err}
        if failed_dirs:
            self._count("write_errors")
            self._warn("disk tier: directory fsync failed", dirs=len(failed_dirs))
        for job in committed:
            job.future.set_result(os.path.dirname(job.final) not in failed_dirs)

    # -- small helpers -----------------------------------------------------------------------

    def _path_of(self, name: str) -> str:
        return os.path.join(self._objects, _diskfile.object_relpath(name))

    def _stripe(self, key: str) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    def _unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._warn("disk tier: could not delete an object file", error=str(exc))

    def _count(self, name: str) -> None:
        with self._mu:
            self._counters[name] += 1

    def _warn(self, event: str, **kw: Any) -> None:
        self._warnings.warning(event, path=str(self.path), **kw)


class _DiskVictim(Victim):
    """An evicted object file, moved aside until the Store has demoted it.

    ``open`` maps the file read-only and checks it whole (header, size, CRC) once; the view
    it returns stays valid even after ``release`` unlinks the file (the mapping outlives
    the name, and is unmapped when the last view is gone).
    """

    __slots__ = ("_lock", "_map", "_path", "_size", "_tier", "_verified")

    def __init__(self, tier: DiskTier, key: str, entry: _Entry, path: str) -> None:
        super().__init__(key, entry.body_len, entry.meta)
        self._tier = tier
        self._path: str | None = path
        self._size = entry.size
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._verified = (entry.header_len, entry.crc)

    def open(self) -> memoryview:
        with self._lock:
            if self._map is None:
                self._map = self._map_verified()
            header_len = self._verified[0]
            return memoryview(self._map)[header_len : header_len + self.length]

    def _map_verified(self) -> mmap.mmap:
        if self._path is None:
            raise TierError("victim already released")
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as exc:
            raise TierError(f"evicted file unreadable: {exc}") from exc
        try:
            if os.fstat(fd).st_size != self._size:
                raise TierError("evicted file has the wrong size")
            mapped = mmap.mmap(fd, self._size, prot=mmap.PROT_READ) if self._size else mmap.mmap(-1, 1)
        finally:
            os.close(fd)
        header_len, crc = self._verified
        try:
            header = _diskfile.decode_header(memoryview(mapped)[:header_len])
        except _diskfile.CorruptFile as exc:
            mapped.close()
            raise TierError(f"evicted file is corrupt: {exc}") from exc
        with memoryview(mapped) as whole:
            body_ok = _diskfile.checksum(whole[header_len : header_len + self.length]) == crc
        if header.key != self.key or header.body_crc != crc or not body_ok:
            mapped.close()
            self._tier._count("corrupt")
            raise TierError("evicted file is corrupt")
        return mapped

    def release(self) -> None:
        with self._lock:
            path, self._path = self._path, None
            mapped, self._map = self._map, None
        if path is None:
            return
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a reader still holds a view: GC unmaps
                mapped.close()
        self._tier._unlink(path)
        self._tier._victim_released(self._size)


class _BatchSyncer:
    """The group-commit thread of ``fsync="batch"``.

    A batch closes when its window has passed since its first object, when it holds
    ``max_bytes``, or as soon as no other put is still writing its temp file (waiting
    longer could not add anything to it): under load batches grow by themselves, and a
    lone put never waits for the timer.
    """

    def __init__(self, tier: DiskTier, window_s: float, max_bytes: int) -> None:
        self._tier = tier
        self._window_s = window_s
        self._max_bytes = max_bytes
        self._cond = threading.Condition()
        self._pending: list[_Job] = []
        self._pending_bytes = 0
        self._writing = 0
        self._first_at = 0.0
        self._closing = False
        self._fsyncs = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="lmserver-disk-fsync")
        self._thread = threading.Thread(target=self._run, name="lmserver-disk-sync", daemon=True)
        self._thread.start()

    def writer_started(self) -> None:
        with self._cond:
            self._writing += 1

    def writer_done(self, job: _Job | None) -> None:
        """A put finished writing its temp file (``job``), or failed (None)."""
        with self._cond:
            self._writing -= 1
            if job is not None:
                if not self._pending:
                    self._first_at = time.monotonic()
                self._pending.append(job)
                self._pending_bytes += job.entry.size
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()
        self._fsyncs.shutdown()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if not self._pending:
                    return
                deadline = self._first_at + self._window_s
                while not self._closing and self._writing and self._pending_bytes < self._max_bytes:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(remaining)
                jobs, self._pending, self._pending_bytes = self._pending, [], 0
            self._tier._sync_batch(jobs, self._fsyncs)
