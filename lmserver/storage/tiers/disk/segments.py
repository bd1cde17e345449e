"""The disk tier's log: segment files that records are appended to and never rewritten.

Strategy (Bitcask's append-only data files, Navy's regions): a segment is one file under
``<root>/segments/``, named by a 16-hex-digit id that only grows. Records are written at
``ALIGN``-aligned offsets, each exactly once, so an offset never holds two different objects
over time: an index row that outlived its record (a crash between an eviction and its index
write) can only ever point at the hole the eviction left, never at another object's bytes.

Space comes back per record, not per segment: an evicted or deleted record's blocks are
released with ``fallocate(PUNCH_HOLE)`` at once (segments are sparse files), so the disk tier
keeps an exact per-object LRU without any compaction pass. A segment whose records are all
gone is unlinked. Filesystems without hole punching (rare: some network and FUSE ones) keep
dead records' blocks until their whole segment is gone; the tier then evicts the oldest
segment's remaining records to make room (see ``DiskTier``).

A segment stays open for reading while it exists. ``users`` counts readers and held
victims that use its descriptor: it is closed only once nobody does, so a read can never
land on a descriptor number that was closed and reused for another file.

Thread-safe: one lock, no I/O under it except ``close``/``unlink`` of a dead segment.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import threading
from collections.abc import Callable, Iterator

from .._diskfile import ALIGN, probe

SEGMENT_BYTES = 1 << 30
"""Logical size at which the writer starts a new segment. Segments are sparse (evicted
records are punched out), so this bounds how long one file stays, not space; a record larger
than this gets a segment of its own."""
SUFFIX = ".log"

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    _fallocate.restype = ctypes.c_int


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Release the blocks of ``[offset, offset + length)`` (reads then return zeros); the
    file keeps its size. Raises OSError (EOPNOTSUPP where the filesystem cannot)."""
    if _fallocate is None:  # pragma: no cover - not Linux
        raise OSError(errno.EOPNOTSUPP, "fallocate is not available")
    if _fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def punch_works(directory: str) -> bool:
    """Whether files in ``directory`` support hole punching: probed on a scratch file."""

    def trial(fd: int) -> None:
        os.pwrite(fd, bytes(2 * ALIGN), 0)
        punch_hole(fd, 0, ALIGN)

    return probe(directory, "punch", os.O_RDWR, trial)


def data_ranges(fd: int, start: int, end: int) -> Iterator[tuple[int, int]]:
    """The ranges of ``[start, end)`` that hold data (not holes), by SEEK_DATA/SEEK_HOLE;
    the whole range where the filesystem cannot tell."""
    offset = start
    while offset < end:
        try:
            data = os.lseek(fd, offset, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but a hole up to the end
                return
            if exc.errno == errno.EINVAL:  # no SEEK_DATA here: all of it may be data
                yield offset, end
                return
            raise
        if data >= end:
            return
        hole = min(os.lseek(fd, data, os.SEEK_HOLE), end)
        yield data, hole
        offset = hole


class Segment:
    """One segment file, open for reading (and, while it is the writer's, for writing)."""

    __slots__ = ("fd", "gone", "id", "live", "path", "sealed", "users")

    def __init__(self, segment_id: int, path: str, fd: int) -> None:
        self.id = segment_id
        self.path = path
        self.fd = fd  # O_RDWR, buffered: reads, punches, buffered writes
        self.live = 0  # records indexed here, held as victims or being written
        self.users = 0  # readers and victims using ``fd`` right now
        self.sealed = False  # no more records will be written here
        self.gone = False  # its file was removed under the server: closed once unused


class SegmentSet:
    """Every segment of one tier's directory."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._segments: dict[int, Segment] = {}
        self.next_id = 1
        self.on_removed: Callable[[int], None] | None = None  # told each removed segment's id

    def path_of(self, segment_id: int) -> str:
        return os.path.join(self.directory, f"{segment_id:016x}{SUFFIX}")

    # -- opening and creating ---------------------------------------------------------------

    def open_existing(self) -> list[Segment]:
        """Open every segment file found (at startup), in id order."""
        found: list[Segment] = []
        with os.scandir(self.directory) as it:
            for entry in it:
                stem, dot, suffix = entry.name.partition(".")
                if dot + suffix != SUFFIX or len(stem) != 16:
                    continue
                try:
                    segment_id = int(stem, 16)
                except ValueError:
                    continue
                fd = os.open(entry.path, os.O_RDWR | os.O_CLOEXEC)
                found.append(Segment(segment_id, entry.path, fd))
        found.sort(key=lambda s: s.id)
        with self._lock:
            for segment in found:
                segment.sealed = True
                self._segments[segment.id] = segment
                self.next_id = max(self.next_id, segment.id + 1)
        return found

    def create(self, *, durable: bool) -> Segment:
        """A new, empty segment for the writer. ``durable``: its directory entry is fsynced
        before any record in it can be acknowledged. Recreates the directory if it was
        removed under the running server (then warns through the caller's OSError path)."""
        with self._lock:
            segment_id = self.next_id
            self.next_id += 1
        path = self.path_of(segment_id)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o644)
        except FileNotFoundError:  # the directory itself is gone: make it again
            os.makedirs(self.directory, exist_ok=True)
            fd = os.open(path, flags, 0o644)
        if durable:
            try:
                _fsync_dir(self.directory)
            except OSError:
                os.close(fd)
                os.unlink(path)
                raise
        segment = Segment(segment_id, path, fd)
        with self._lock:
            self._segments[segment_id] = segment
        return segment

    # -- lookup and reference counts ------------------------------------------------------------

    def get(self, segment_id: int) -> Segment | None:
        return self._segments.get(segment_id)

    def __iter__(self) -> Iterator[Segment]:
        with self._lock:
            return iter(list(self._segments.values()))

    def __len__(self) -> int:
        return len(self._segments)

    def acquire(self, segment_id: int) -> Segment | None:
        """Pin a segment's descriptor for a read (None if the segment is gone)."""
        with self._lock:
            segment = self._segments.get(segment_id)
            if segment is not None:
                segment.users += 1
            return segment

    def release(self, segment: Segment) -> None:
        with self._lock:
            segment.users -= 1
            dead = self._dead_locked(segment)
            close_gone = segment.gone and segment.users == 0
        if dead:
            self._remove(segment)
        elif close_gone:
            os.close(segment.fd)

    def add_live(self, segment: Segment, count: int = 1) -> None:
        with self._lock:
            segment.live += count

    def drop_live(self, segment_id: int, count: int = 1) -> None:
        """Records of the segment are gone for good (punched or failed); unlink it once
        nothing lives in it, it is sealed and nobody reads it."""
        with self._lock:
            segment = self._segments.get(segment_id)
            if segment is None:
                return
            segment.live -= count
            dead = self._dead_locked(segment)
        if dead:
            self._remove(segment)

    def seal(self, segment: Segment) -> None:
        with self._lock:
            segment.sealed = True
            dead = self._dead_locked(segment)
        if dead:
            self._remove(segment)

    def _dead_locked(self, segment: Segment) -> bool:
        if segment.sealed and segment.live <= 0 and segment.users <= 0 and segment.id in self._segments:
            del self._segments[segment.id]
            return True
        return False

    def _remove(self, segment: Segment) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(segment.path)
        os.close(segment.fd)
        if self.on_removed is not None:
            self.on_removed(segment.id)

    def forget_missing(self) -> list[Segment]:
        """Segments whose file was removed under the running server (``rm -rf`` of the
        directory): dropped from the set, their descriptors closed once unused."""
        gone = []
        for segment in self:
            try:
                missing = os.fstat(segment.fd).st_nlink == 0
            except OSError:
                missing = True
            if missing:
                gone.append(segment)
        closing = []
        with self._lock:
            for segment in gone:
                self._segments.pop(segment.id, None)
                segment.gone = True
                if segment.users <= 0:
                    closing.append(segment)
        for segment in closing:
            os.close(segment.fd)
        return gone

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            with contextlib.suppress(OSError):
                os.close(segment.fd)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
