"""Timeouts, checked by a periodic sweep (``sweep``, a server task), never per request.

Strategy: the read path only counts bytes received and requests parsed. Every sweep compares
those counts with what it saw last time (``Progress``): a connection whose counts did not
move for a timeout, in a phase where the peer owes us bytes, is cut off. What each phase
waits for (docs/operating.md "Limits and timeouts"):

* a body arriving or being dropped: ``--body-timeout`` since the last byte;
* a header begun and not completed: ``--header-timeout`` since the last request parsed;
* replies the peer does not read: ``--body-timeout`` since the transport's unsent bytes last
  changed;
* nothing (between requests): ``--idle-timeout``, enforced only while the server is short of
  connections (three quarters of ``--max-connections`` in use).

A connection waiting for the server itself (an operation, a PUT_ACK's write) never times out.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from .phase import DISCARDING, RECEIVING_BODY, Phase

if TYPE_CHECKING:
    from ..state import ServerState

IDLE: Final = "idle_closed"
"""``Progress.verdict``: close this idle connection to make room (counted as ``idle_closed``)."""

REASONS: Final = {
    "send_timeouts": "replies not read",
    "body_timeouts": "request body stalled",
    "header_timeouts": "request header incomplete",
}
"""The timeouts ``Progress.verdict`` may return (their counters) and what each means."""


class Progress:
    """What the sweep saw of one connection last time, and since when nothing moved."""

    def __init__(self, now: float = 0.0) -> None:
        self.seen_received = 0
        self.quiet_since = now  # since when no byte arrived
        self.header_since: float | None = None
        self.seen_parsed = 0
        self.seen_unsent = -1
        self.send_since = 0.0

    def received_since(self, now: float, received: int) -> bool:
        """Whether bytes arrived since the last sweep (noting when, if so)."""
        if received != self.seen_received:
            self.seen_received, self.quiet_since = received, now
            return True
        return False

    def idle_since(self, now: float, received: int) -> float:
        """Since when no byte arrived: ``now`` if some did since the last sweep."""
        return self.quiet_since if received == self.seen_received else now

    def verdict(
        self, now: float, config: Any, phase: Phase, parsed: int, unsent: Callable[[], int], close_idle: bool
    ) -> str | None:
        """What to do with the connection after this sweep: None, ``IDLE``, or the counter of
        the timeout it ran into (a key of ``REASONS``). Call ``received_since`` first."""
        quiet = now - self.quiet_since
        if phase.replies.write_paused:  # replies the peer does not read: they must drain steadily
            pending = unsent()
            if pending != self.seen_unsent:
                self.seen_unsent, self.send_since = pending, now
            elif config.body_timeout and now - self.send_since >= config.body_timeout:
                return "send_timeouts"
            return None
        self.seen_unsent = -1
        if phase.waiting_for_server():
            return None
        current = phase.current
        staging = phase.staging
        verdict = None
        if current in (RECEIVING_BODY, DISCARDING):
            if config.body_timeout and quiet >= config.body_timeout:
                verdict = "body_timeouts"
        elif staging.end > staging.start:  # a header has started and not completed
            if self.header_since is None or parsed != self.seen_parsed:
                self.header_since, self.seen_parsed = now, parsed
            elif config.header_timeout and now - self.header_since >= config.header_timeout:
                return "header_timeouts"
            return None
        elif (
            close_idle
            and config.idle_timeout
            and quiet >= config.idle_timeout
            and not phase.replies.acks_in_flight
        ):
            verdict = IDLE
        self.header_since = None
        return verdict


def sweep_interval(config: Any) -> float:
    """How often timeouts are checked: a quarter of the shortest one, within 50 ms - 1 s."""
    timeouts = [t for t in (config.idle_timeout, config.header_timeout, config.body_timeout) if t]
    return min(1.0, max(0.05, min(timeouts, default=4.0) / 4))


async def sweep(state: ServerState) -> None:
    """Check every connection's timeouts and staging buffer, forever (a server task)."""
    config = state.config
    interval = sweep_interval(config)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        close_idle = len(state.connections) + len(state.handshakes) > config.max_connections * 3 // 4
        for connection in list(state.connections):
            connection.tick(now, close_idle)
