"""The disk tier's recency clock, persisted in batches.

Strategy: every use of an object (a write, a GET served from disk or from memory in front)
stamps it with the next tick of one clock; the ticks reach SQLite as the ``recency`` column,
so a restart loads the index in LRU order. A GET must not cost a database write, so uses are
batched: at most every ``flush_s`` seconds, or ``BATCH`` keys, or at close (and the index
writer flushes when it idles).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from . import index as dbindex

BATCH = 4096


class Recency:
    """Thread-safe: used from the event loop and from the tier's threads."""

    def __init__(self, flush_s: float, submit: Callable[[dbindex.Op], None], clock: int = 0) -> None:
        self._flush_s = flush_s
        self._submit = submit
        self._lock = threading.Lock()
        self._clock = clock  # the last tick given out
        self._touches: dict[str, int] = {}
        self._since = time.monotonic()

    def stamp(self, key: str) -> int:
        """A tick for a write of ``key``, persisted with its row (a pending use is moot)."""
        with self._lock:
            self._clock += 1
            self._touches.pop(key, None)
            return self._clock

    def used(self, key: str) -> None:
        """``key`` was used: its new tick reaches SQLite with the next batch."""
        with self._lock:
            self._clock += 1
            self._touches[key] = self._clock
        self.flush()

    def flush(self, force: bool = False) -> None:
        """Hand the batch to the index writer when it is due (or ``force``)."""
        with self._lock:
            if not self._touches:
                self._since = time.monotonic()
                return
            due = len(self._touches) >= BATCH or time.monotonic() - self._since >= self._flush_s
            if not (force or due):
                return
            touches, self._touches = self._touches, {}
            self._since = time.monotonic()
        self._submit(dbindex.touch_op(touches))
