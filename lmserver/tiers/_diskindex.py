"""The DiskTier's persisted index: SQLite (WAL mode), owned by one writer thread.

Strategy: the object files are the truth (they are self-describing), the in-memory index
answers every lookup, and SQLite only makes a restart fast: it holds one row per object
(key, file name, sizes, checksum, v1 metadata, recency) so ``open()`` loads the whole index
in LRU order with one query instead of reading every file's header.

Writes never wait for SQLite. The tier queues small operations (upsert, delete, recency
updates) and one dedicated thread, the only user of the connection once the tier is open,
runs everything queued so far in one transaction: a burst of puts costs one commit.
``synchronous=NORMAL`` is enough because a lost tail of the index is repaired from the
files: the ``clean`` flag in the ``meta`` table is set only by an orderly close, and an
open that finds it unset reconciles the index with the files on disk.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import structlog

log = structlog.get_logger(__name__)

SCHEMA_VERSION = "1"

GROWTH_ROOM = 5 << 20
"""Free space the index needs beyond its current files: the WAL grows to ~4 MiB (SQLite's
default autocheckpoint, 1000 pages) before it is reused, plus the shared-memory file that
an open creates. The disk tier leaves this much free when its filesystem fills up."""

Row = tuple[str, str, int, int, int, int, int, int, int, int, int, int, int, int]
"""key, file, size, header_len, body_len, crc, fmt, dtype, s0, s1, s2, s3, location, recency."""

Op = Callable[[sqlite3.Connection], object]

_COLUMNS = "key, file, size, header_len, body_len, crc, fmt, dtype, s0, s1, s2, s3, location, recency"
_UPSERT = f"INSERT OR REPLACE INTO objects ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)"
_TOUCH = "UPDATE objects SET recency = ? WHERE key = ? AND recency < ?"


def connect(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) the index database. Raises sqlite3.DatabaseError."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA journal_mode=WAL").fetchone()
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(
            "CREATE TABLE IF NOT EXISTS objects ("
            " key TEXT PRIMARY KEY NOT NULL, file TEXT NOT NULL, size INTEGER NOT NULL,"
            " header_len INTEGER NOT NULL, body_len INTEGER NOT NULL, crc INTEGER NOT NULL,"
            " fmt INTEGER NOT NULL, dtype INTEGER NOT NULL, s0 INTEGER NOT NULL, s1 INTEGER NOT NULL,"
            " s2 INTEGER NOT NULL, s3 INTEGER NOT NULL, location INTEGER NOT NULL,"
            " recency INTEGER NOT NULL)"
        )
        conn.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY NOT NULL, v TEXT NOT NULL)")
    except BaseException:
        conn.close()
        raise
    return conn


def get_meta(conn: sqlite3.Connection, key: str) -> str | None:
    row = conn.execute("SELECT v FROM meta WHERE k = ?", (key,)).fetchone()
    return None if row is None else str(row[0])


def set_meta(conn: sqlite3.Connection, key: str, value: str) -> None:
    conn.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (key, value))


def set_meta_durably(conn: sqlite3.Connection, key: str, value: str) -> None:
    """Commit one meta value with a full fsync (used for the ``clean`` flag at open)."""
    conn.execute("PRAGMA synchronous=FULL")
    try:
        set_meta(conn, key, value)
    finally:
        conn.execute("PRAGMA synchronous=NORMAL")


def load_rows(conn: sqlite3.Connection) -> Iterator[Row]:
    """Every row, least recently used first."""
    return conn.execute(f"SELECT {_COLUMNS} FROM objects ORDER BY recency")


def apply_changes(conn: sqlite3.Connection, *, deletes: Iterable[str] = (), rows: Iterable[Row] = ()) -> None:
    conn.execute("BEGIN")
    conn.executemany("DELETE FROM objects WHERE key = ?", [(k,) for k in deletes])
    conn.executemany(_UPSERT, rows)
    conn.execute("COMMIT")


def upsert_op(row: Row) -> Op:
    return lambda conn: conn.execute(_UPSERT, row)


def delete_op(key: str) -> Op:
    return lambda conn: conn.execute("DELETE FROM objects WHERE key = ?", (key,))


def delete_many_op(keys: list[str]) -> Op:
    return lambda conn: conn.executemany("DELETE FROM objects WHERE key = ?", [(k,) for k in keys])


def touch_op(touches: dict[str, int]) -> Op:
    params = [(recency, key, recency) for key, recency in touches.items()]
    return lambda conn: conn.executemany(_TOUCH, params)


def set_meta_op(key: str, value: str) -> Op:
    return lambda conn: set_meta(conn, key, value)


class IndexWriter:
    """The thread that owns the SQLite connection after open and applies queued operations.

    ``submit`` never blocks on SQLite. ``on_idle`` runs in the writer thread whenever the
    queue stays empty for ``idle_s`` (the tier uses it to flush batched recency updates).
    A failing transaction is logged, counted in ``errors`` and rolled back; the in-memory
    index stays authoritative and the next open reconciles (close leaves ``clean`` unset).
    """

    def __init__(
        self, conn: sqlite3.Connection, *, idle_s: float, on_idle: Callable[[], None] | None = None
    ) -> None:
        self._conn = conn
        self._idle_s = idle_s
        self._on_idle = on_idle
        self._cond = threading.Condition()
        self._ops: list[Op | concurrent.futures.Future[None]] = []
        self._closing = False
        self.errors = 0
        self._last_warning = 0.0
        self._thread = threading.Thread(target=self._run, name="lmserver-disk-index", daemon=True)
        self._thread.start()

    def submit(self, op: Op) -> None:
        with self._cond:
            self._ops.append(op)
            self._cond.notify()

    def flush(self) -> concurrent.futures.Future[None]:
        """A future that completes once everything submitted before it is committed."""
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._cond:
            self._ops.append(done)
            self._cond.notify()
        return done

    def close(self) -> None:
        """Apply what is queued, close the connection and join the thread (blocking)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._ops and not self._closing:
                        self._cond.wait(self._idle_s)
                    batch, self._ops = self._ops, []
                    closing = self._closing
                if batch:
                    self._apply(batch)
                elif closing:
                    return
                elif self._on_idle is not None:
                    self._on_idle()
        finally:
            self._conn.close()

    def _apply(self, batch: list[Op | concurrent.futures.Future[None]]) -> None:
        waiters: list[concurrent.futures.Future[None]] = []
        try:
            self._conn.execute("BEGIN")
            for op in batch:
                if isinstance(op, concurrent.futures.Future):
                    waiters.append(op)
                else:
                    op(self._conn)
            self._conn.execute("COMMIT")
        except Exception as exc:  # sqlite3.Error, or a bug: never kill the writer thread
            self.errors += 1
            self._warn(exc, len(batch))
            with contextlib.suppress(sqlite3.Error):
                self._conn.execute("ROLLBACK")
        for waiter in waiters:
            waiter.set_result(None)

    def _warn(self, exc: Exception, ops: int) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            log.warning("disk index write failed", error=str(exc), ops=ops, errors=self.errors)
