"""Opening a disk tier: the index from SQLite, checked against the segments when needed.

Strategy:

* **Clean restart** (the last run closed the tier): every row is loaded in LRU order with
  one query; no record is read. 100,000 objects: a fraction of a second.
* **After a crash** (the ``clean`` flag unset, or ``check_files``): rows of segments that are
  gone are dropped; each segment is read from its persisted watermark up, header by header
  (records the writer placed but whose rows never reached SQLite: an acknowledged PUT is
  never lost to a crash), a record later in the log replacing an older row of its key; and
  the space no indexed record covers (a torn tail, evictions whose rows were not written
  yet) is punched out, so ``--disk-limit`` holds from the first request.
* **A lost or unreadable index** is rebuilt from every segment's headers, least recently
  written first, with progress logged.

Everything here runs once, on a worker thread, before the tier serves.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from .._diskfile import ALIGN, CorruptFile, Header
from . import index as dbindex
from .records import Record, from_header, read_header
from .segments import Segment, SegmentSet, data_ranges, punch_hole

log = structlog.get_logger(__name__)

_PROGRESS_EVERY = 10_000


@dataclass
class Loaded:
    """What an open found: the index in LRU order and how it got it."""

    conn: sqlite3.Connection
    records: OrderedDict[str, Record] = field(default_factory=OrderedDict)
    clock: int = 0  # the highest recency persisted
    source: str = "new"  # "index", "rebuilt" or "new"
    reconciled: bool = False
    missing: int = 0  # rows dropped: their segment is gone


def scan(segment: Segment, start: int = 0) -> Iterator[tuple[int, Header]]:
    """The whole-headed records of ``segment`` from ``start`` on, in log order. Holes are
    skipped by SEEK_DATA; a block that holds no valid header is stepped over."""
    fd = segment.fd
    end = os.fstat(fd).st_size
    offset = -(-start // ALIGN) * ALIGN
    for data_start, data_end in data_ranges(fd, offset, end):
        offset = max(offset, data_start - data_start % ALIGN)
        while offset < data_end:
            try:
                header = read_header(fd, offset, end)
            except CorruptFile:
                offset += ALIGN
                continue
            yield offset, header
            offset += from_header(0, 0, header).size


def load(db_path: Path, segments: SegmentSet, *, check_files: bool | None) -> Loaded:
    """Open the index at ``db_path`` (rebuilding it from ``segments`` if it is missing or
    unreadable) and reconcile it after an unclean stop. Raises sqlite3.DatabaseError only
    when the filesystem is full (the caller says so plainly)."""
    existed = db_path.exists()
    if existed:
        conn: sqlite3.Connection | None = None
        try:
            conn = dbindex.connect(db_path)
            schema = dbindex.get_meta(conn, "schema")
            if schema == dbindex.SCHEMA_VERSION:
                loaded = _load_rows(conn)
                if check_files or (check_files is None and dbindex.get_meta(conn, "clean") != "1"):
                    _reconcile(loaded, segments)
                return loaded
            log.warning("disk index has another schema; rebuilding from the segments", schema=schema)
        except sqlite3.DatabaseError as exc:
            if filesystem_full(exc, db_path.parent):
                if conn is not None:
                    conn.close()
                raise
            log.warning("disk index is unreadable; rebuilding from the segments", error=str(exc))
        if conn is not None:
            conn.close()
        with contextlib.suppress(FileNotFoundError):
            os.replace(db_path, db_path.with_name(db_path.name + ".corrupt"))
    for suffix in ("-wal", "-shm"):  # never let a stale WAL meet a new database
        with contextlib.suppress(FileNotFoundError):
            os.unlink(db_path.with_name(db_path.name + suffix))
    conn = dbindex.connect(db_path)
    try:
        loaded = Loaded(conn)
        _rebuild(loaded, segments, announce=existed)
        dbindex.set_meta(conn, "schema", dbindex.SCHEMA_VERSION)
    except BaseException:
        conn.close()
        raise
    loaded.source = "rebuilt" if existed or loaded.records else "new"
    return loaded


def _load_rows(conn: sqlite3.Connection) -> Loaded:
    loaded = Loaded(conn, source="index")
    loaded.records, loaded.clock = dbindex.load_records(conn)
    return loaded


def _reconcile(loaded: Loaded, segments: SegmentSet) -> None:
    """After an unclean stop: drop rows of lost segments, index records above each
    segment's watermark, punch out space no record covers."""
    started = time.monotonic()
    records = loaded.records
    present = {segment.id for segment in segments}
    gone = [key for key, rec in records.items() if rec.segment not in present]
    for key in gone:
        del records[key]
    marks = dbindex.load_watermarks(loaded.conn)
    found: list[tuple[int, str, Record]] = []
    for segment in segments:
        for offset, header in scan(segment, marks.get(segment.id, 0)):
            found.append((header.written_ns, header.key, from_header(segment.id, offset, header)))
    added = _adopt(loaded, found)
    punched = punch_uncovered(segments, records)
    dbindex.apply_changes(loaded.conn, deletes=gone, rows=_rows(added, loaded), watermarks=_ends(segments))
    loaded.reconciled = True
    loaded.missing = len(gone)
    if gone or added or punched:
        log.info(
            "disk index reconciled with the segments",
            rows_dropped=len(gone),
            records_added=len(added),
            bytes_punched=punched,
            seconds=round(time.monotonic() - started, 3),
        )


def _rebuild(loaded: Loaded, segments: SegmentSet, *, announce: bool) -> None:
    """Index every record of every segment (least recently written first)."""
    started = time.monotonic()
    found: list[tuple[int, str, Record]] = []
    for segment in segments:
        for offset, header in scan(segment):
            found.append((header.written_ns, header.key, from_header(segment.id, offset, header)))
            if len(found) % _PROGRESS_EVERY == 0:
                log.info("disk index rebuild in progress", records=len(found), segment=segment.id)
    added = _adopt(loaded, found)
    punched = punch_uncovered(segments, loaded.records)
    dbindex.apply_changes(loaded.conn, rows=_rows(added, loaded), watermarks=_ends(segments))
    if announce or added:
        log.info(
            "disk index rebuilt from the segments",
            records=len(added),
            bytes_punched=punched,
            seconds=round(time.monotonic() - started, 3),
        )


def _adopt(loaded: Loaded, found: list[tuple[int, str, Record]]) -> list[str]:
    """Index found records that are newer (later in the log) than what the index holds,
    least recently written first; returns the keys added or replaced."""
    records = loaded.records
    added = []
    for _ns, key, rec in sorted(found, key=lambda t: (t[0], t[2].segment, t[2].offset)):
        old = records.get(key)
        if old is not None and (old.segment, old.offset) >= (rec.segment, rec.offset):
            continue  # the index already has this record, or a newer one
        records.pop(key, None)
        records[key] = rec
        added.append(key)
    return added


def _rows(keys: list[str], loaded: Loaded) -> list[dbindex.Row]:
    rows = []
    for key in keys:
        loaded.clock += 1
        rows.append(dbindex.row(key, loaded.records[key], loaded.clock))
    return rows


def _ends(segments: SegmentSet) -> dict[int, int]:
    """Every segment is now indexed up to its end."""
    return {segment.id: os.fstat(segment.fd).st_size for segment in segments}


def punch_uncovered(segments: SegmentSet, records: OrderedDict[str, Record]) -> int:
    """Punch out every data range of every segment that no indexed record covers; returns
    the bytes released (a crash leaves torn writes and evicted records whose rows stayed)."""
    by_segment: dict[int, list[tuple[int, int]]] = {}
    for rec in records.values():
        by_segment.setdefault(rec.segment, []).append((rec.offset, rec.offset + rec.size))
    released = 0
    for segment in segments:
        live = sorted(by_segment.get(segment.id, ()))
        end = os.fstat(segment.fd).st_size
        i = 0
        for start, stop in list(data_ranges(segment.fd, 0, end)):
            cursor = start
            while i < len(live) and live[i][1] <= start:
                i += 1
            j = i
            while j < len(live) and live[j][0] < stop:
                if live[j][0] > cursor:
                    released += _punch(segment, cursor, live[j][0])
                cursor = max(cursor, live[j][1])
                j += 1
            if cursor < stop:
                released += _punch(segment, cursor, stop)
    return released


def _punch(segment: Segment, start: int, stop: int) -> int:
    try:
        punch_hole(segment.fd, start, stop - start)
    except OSError:
        return 0  # no hole punching here: the space stays until the segment goes
    return stop - start


def filesystem_full(exc: BaseException, directory: Path) -> bool:
    """Did SQLite fail for want of space? (A full disk can also surface as an I/O error,
    e.g. SQLITE_IOERR_SHMSIZE when the WAL index cannot grow.)"""
    if not isinstance(exc, sqlite3.OperationalError):
        return False
    code = getattr(exc, "sqlite_errorcode", 0)
    if code == sqlite3.SQLITE_FULL:
        return True
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return code & 0xFF == sqlite3.SQLITE_IOERR and st.f_bavail * st.f_frsize < (1 << 20)
