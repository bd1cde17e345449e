"""Per-command latency histograms of the requests not answered inline (a lower-tier read, a
DELETE, a PUT waiting for memory or a PUT_ACK for its write), filled only while metrics are
served (``--metrics-port``) and read by metrics.py. Apart from metrics.py, so the server state
can hold one without importing the Prometheus side."""

from __future__ import annotations

import bisect

LATENCY_BOUNDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Upper bounds (seconds) of the latency buckets: 100 µs (a memory hit) to 10 s (a PUT waiting
for memory, ``--memory-wait``)."""


class LatencyRecorder:
    """Per-command histograms as plain int lists, bumped on the event loop only."""

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BOUNDS) -> None:
        self.bounds = bounds
        self.counts: dict[int, list[int]] = {}
        self.sums: dict[int, float] = {}

    def record(self, command: int, seconds: float) -> None:
        counts = self.counts.get(command)
        if counts is None:
            counts = self.counts[command] = [0] * (len(self.bounds) + 1)
            self.sums[command] = 0.0
        counts[bisect.bisect_left(self.bounds, seconds)] += 1  # bucket "le=b" includes b
        self.sums[command] += seconds

    def copy(self) -> tuple[dict[int, list[int]], dict[int, float]]:
        return {c: list(v) for c, v in self.counts.items()}, dict(self.sums)
