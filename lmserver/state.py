"""State shared by the server and all its connections."""

from __future__ import annotations

import asyncio
import operator
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from .access import AccessList
from .config import ServerConfig
from .heap import HeapTrimmer
from .storage.store import Store

if TYPE_CHECKING:
    from .latency import LatencyRecorder


class Occupant(Protocol):
    """What holds a slot of --max-connections (admission.py): an open connection or a TLS
    handshake in progress."""

    address: str | None

    def idle_since(self, now: float) -> float | None:
        """Loop time since which it has waited for its peer with nothing in progress
        (``now`` if it was busy moments ago), or None while it serves a request."""
        ...

    def displace(self) -> None:
        """Close it to make room for a newcomer (counted by the occupant)."""
        ...


class Handshake(Occupant, Protocol):
    """A TLS handshake in progress (admission.py's ``PendingHandshake``)."""

    task: asyncio.Task[None] | None


class Connection(Occupant, Protocol):
    """An open connection (connection/protocol.py's ``LMProtocol``), as the server, the
    sweep, STATS and admission see it. A protocol type, so this module imports no connection
    code (and the connection's modules import this one)."""

    by_command: list[int]
    handshake: Any
    transport: Any

    def add_counts(self) -> None:
        """Add the counts it keeps in plain ints to the server's counters and its by_command."""
        ...

    def tick(self, now: float, close_idle: bool) -> None:
        """One sweep: check its timeouts (connection/sweep.py)."""
        ...

    def shutdown(self) -> None:
        """Serve what it received, read nothing new, then close."""
        ...

    def buffer_bytes(self) -> int:
        """Memory it holds outside --memory-limit (staging and reply buffers)."""
        ...


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    connections: set[Connection] = field(default_factory=set)
    # TLS handshakes in progress: each holds a slot of --max-connections (admission.py).
    handshakes: set[Handshake] = field(default_factory=set)
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
