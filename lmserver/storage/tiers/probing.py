"""How much a shared tier may spend looking in its backend for GETs that miss its index.

A tier shared by several servers (a bucket, a shared directory) indexes what it wrote and
learns what the others wrote only from a listing every ``refresh`` seconds. So that a GET on
one server finds what another wrote before that listing, the tier may look in the backend
when a GET misses its index (one small request: a header range read, a paths-info call).
``ProbeGate`` bounds that: at most ``limit`` look-ups at once (a GET past that misses at
once, and the tier counts it ``probes_skipped``), and none for ``pause_s`` after one failed,
so a backend that is down or slow costs GETs nothing past the first failure.

Look-ups start and end on the event loop (``enter``/``leave``); ``failed`` may be called
from any thread.
"""

from __future__ import annotations

import time

PROBE_LIMIT = 16
PROBE_PAUSE_S = 5.0


class ProbeGate:
    def __init__(self, limit: int = PROBE_LIMIT, pause_s: float = PROBE_PAUSE_S) -> None:
        self.limit = limit
        self.pause_s = pause_s
        self._inflight = 0
        self._paused_until = 0.0

    def enter(self) -> bool:
        """Take a slot for one look-up; False (take none) when full or paused."""
        if self._inflight >= self.limit or time.monotonic() < self._paused_until:
            return False
        self._inflight += 1
        return True

    def leave(self) -> None:
        self._inflight -= 1

    def failed(self) -> None:
        self._paused_until = time.monotonic() + self.pause_s
