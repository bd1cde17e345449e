"""State shared by the server and all its connections."""

from __future__ import annotations

import asyncio
import operator
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .access import AccessList
from .config import ServerConfig
from .heap import HeapTrimmer
from .storage.store import Store

if TYPE_CHECKING:
    from .admission import PendingHandshake
    from .connection import LMProtocol
    from .metrics import LatencyRecorder


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    connections: set[LMProtocol] = field(default_factory=set)
    # TLS handshakes in progress: each holds a slot of --max-connections (admission.py).
    handshakes: set[PendingHandshake] = field(default_factory=set)
    # Slots held per peer address, connections and handshakes alike (admission.py).
    connections_per_address: Counter[str] = field(default_factory=Counter)
    heap: HeapTrimmer = field(default_factory=HeapTrimmer)  # trims the C heap after many closes
    # Event counts by name; read them through current_counters(), .get(name, 0). A
    # defaultdict, not a Counter: `counters[name] += n` runs on the request path, and Counter,
    # a Python subclass of dict, makes every subscript a slot lookup and a call through Python.
    counters: defaultdict[str, int] = field(default_factory=lambda: defaultdict(int))
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False
    tasks: set[asyncio.Future[object]] = field(default_factory=set)
    # Set whenever no connection is open (the shutdown waits on it).
    no_connections: asyncio.Event = field(default_factory=asyncio.Event)
    access: AccessList = field(default_factory=lambda: AccessList(()))
    # Per-command latency histograms, filled only when metrics are served (see metrics.py).
    latency: LatencyRecorder | None = None
    # Requests by command number of the connections already closed (see LMProtocol.by_command).
    closed_by_command: list[int] = field(default_factory=list)

    def current_counters(self) -> defaultdict[str, int]:
        """``counters`` brought up to date: each open connection first adds the counts it
        keeps in plain ints on its hot path (requests, bytes received, GET hits and bytes,
        and its running count by command; see LMProtocol.add_counts). Read counters
        through this, on the event loop."""
        for connection in self.connections:
            connection.add_counts()
        return self.counters

    def release_address(self, address: str | None) -> None:
        """A slot taken by ``Admission.admit`` for ``address`` is free again."""
        self.heap.closed()
        if address is not None:
            per_address = self.connections_per_address
            per_address[address] -= 1
            if per_address[address] <= 0:
                del per_address[address]

    def fold_command_counts(self, counts: list[int]) -> None:
        _add_into(self.closed_by_command, counts)

    def requests_by_command(self) -> list[int]:
        """Requests by command number so far, open connections included."""
        totals = list(self.closed_by_command)
        for connection in self.connections:
            connection.add_counts()  # its running counts into its by_command
            _add_into(totals, connection.by_command)
        return totals


def _add_into(totals: list[int], counts: list[int]) -> None:
    if len(totals) < len(counts):
        totals += [0] * (len(counts) - len(totals))
    # In C, not a Python loop: a scrape adds up every open connection's counts (~100 each).
    totals[: len(counts)] = map(operator.add, totals, counts)
