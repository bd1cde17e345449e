"""Failures an LMCache integration turns into misses: counted by kind, logged sparingly.

Strategy: an engine must never see an exception from its cache, so the LMCache plugin
(lmcache.py) and the L2 adapter (lmcache_mp.py) answer every failure as a miss; this keeps
them visible. One line per kind at most every ``every`` seconds, so a server that stays down
costs one line per period, not one per operation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter


class FailureLog:
    """Failures by kind (thread-safe): `record` counts and maybe logs, `counts` reads."""

    def __init__(self, log: logging.Logger, what: str, every: float = 30.0) -> None:
        self._log = log
        self._what = what
        self._every = every
        self._counts: Counter[str] = Counter()
        self._logged: dict[str, float] = {}
        self._lock = threading.Lock()

    def record(self, kind: str, exc: BaseException, count: int = 1) -> None:
        """Count ``count`` failures of ``kind``; log this one unless ``kind`` was logged
        less than ``every`` seconds ago."""
        now = time.monotonic()
        with self._lock:
            self._counts[kind] += count
            if now - self._logged.get(kind, -self._every) < self._every:
                return
            self._logged[kind] = now
            total = self._counts[kind]
        self._log.warning(
            "%s %s failed (%d so far): %s: %s", self._what, kind, total, type(exc).__name__, exc
        )

    def counts(self) -> Counter[str]:
        with self._lock:
            return Counter(self._counts)
