"""Who may hold a connection, decided when a TCP connection is accepted: before a byte is
read from it and before a TLS handshake begins.

Strategy:

* Every socket a peer holds takes one *slot*: a connection being served (``Connection``) or
  a TLS handshake in progress (``PendingHandshake``, which holds an SSL object: ~50 KiB).
  ``--max-connections`` bounds the slots, ``--max-connections-per-address`` one address's
  share of them, ``--allow`` who may take one. A refused socket is closed at once, counted
  (``connections_refused_<reason>``) and logged, throttled.
* At ``--max-connections`` a newcomer *displaces* an idle occupant rather than being refused,
  so a crowd of idle sockets that reconnect as soon as they are closed cannot lock a client
  out. The one displaced is the longest idle of the address that holds the most slots: a
  crowd pays for itself before an engine's single idle connection does. An occupant in the
  middle of a request is never displaced; when no occupant is idle, the newcomer is refused.
* Candidates are ranked by one scan, then taken one per newcomer, each checked again (still
  idle, and idle since the same time). A ranking is rebuilt when used up, stale (a candidate
  closed or got busy), ``RANKING_TTL_S`` old, or down to less crowded addresses than it
  began with, so a storm of newcomers costs about one scan per crowded address's share of
  connections, not one per newcomer.
* A TLS handshake must finish within ``HANDSHAKE_TIMEOUT_S``. Its slot and its address's
  share are taken at accept and passed on to the connection once the handshake is done, or
  given back when it fails.
"""

from __future__ import annotations

import asyncio
import functools
import socket
import ssl
import traceback
from typing import TYPE_CHECKING, Any, cast

import structlog

from .logs import ThrottledWarnings
from .tls import HANDSHAKE_TIMEOUT_S

if TYPE_CHECKING:
    from .state import Connection, Handshake, Occupant, ServerState

log = structlog.get_logger("lmserver.admission")
throttled = ThrottledWarnings(log)

RANKING_TTL_S = 1.0
"""How long a ranking of idle occupants is used before it is rebuilt (idleness changes)."""

NOTHING_IDLE_RETRY_S = 0.1
"""After a scan found no idle occupant, newcomers are refused without a scan for this long:
at the limit with every connection busy, accepting must not cost a scan per newcomer."""


def address_of(peername: Any) -> str | None:
    """The address connections are counted by (``peername[0]``); None without one."""
    return peername[0] if isinstance(peername, tuple) and peername else None


class PendingHandshake:
    """A TLS connection admitted and handshaking: idle (from the server's side) since accept.
    Its slot passes to the connection at ``connection_made`` (``hand_over``)."""

    def __init__(
        self, address: str | None, accepted_at: float, sock: socket.socket, pending: set[Handshake]
    ) -> None:
        self.address = address
        self.accepted_at = accepted_at
        # Ours to close until the handshake task begins; the loop's from then on.
        self.sock: socket.socket | None = sock
        self.task: asyncio.Task[None] | None = None
        self.displaced = False
        self.handed_over = False
        self._pending = pending
        pending.add(self)

    def idle_since(self, now: float) -> float | None:
        return None if self.displaced else self.accepted_at

    def displace(self) -> None:
        self.displaced = True  # gone on the loop's next turn; never a candidate again
        if self.task is not None:
            self.task.cancel()

    def hand_over(self, connection: Connection) -> None:
        """The handshake is done: ``connection`` holds the slot (and gives it back on close)."""
        self.handed_over = True
        self._pending.discard(self)
        connection.address = self.address


class Admission:
    """Slots for the connections of one server (its plain and TLS listeners alike)."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.config = state.config
        self.counters = state.counters
        # Idle occupants, with the time each was idle since and the slots its address held,
        # the best to displace last; _top: the slots of the address ranked first.
        self._ranking: list[tuple[Occupant, float, int]] = []
        self._top = 0
        self._ranked_at = 0.0
        self._rank_again_at = 0.0

    def occupied(self) -> int:
        return len(self.state.connections) + len(self.state.handshakes)

    def admit(self, peername: Any) -> bool:
        """Give the socket just accepted from ``peername`` a slot (its address's count goes up
        until ``state.release_address``), or refuse it: counted and logged, the caller closes it."""
        state, config = self.state, self.config
        if not state.access.allows(peername):
            self._refuse("not_allowed", peername)
            return False
        address = address_of(peername)
        held = state.connections_per_address[address] if address is not None else 0
        if state.shutting_down:
            reason = "shutting_down"
        elif held >= config.max_connections_per_address:
            reason = "per_address"
        elif self.occupied() >= config.max_connections and not self._displace_one():
            reason = "max"
        else:
            if address is not None:
                state.connections_per_address[address] += 1
            return True
        self._refuse(reason, peername)
        return False

    def _refuse(self, reason: str, peername: Any) -> None:
        self.counters["connections_refused"] += 1
        self.counters[f"connections_refused_{reason}"] += 1
        if reason == "not_allowed":
            throttled.warning("connection from an address not allowed", peer=peername)
        else:
            throttled.warning(
                "connection refused",
                peer=peername,
                reason=reason,
                max_connections=self.config.max_connections,
                max_connections_per_address=self.config.max_connections_per_address,
            )

    # -- displacement ----------------------------------------------------------------------

    def _displace_one(self) -> bool:
        now = asyncio.get_running_loop().time()
        if now - self._ranked_at >= RANKING_TTL_S:
            self._ranking = []
        ranked = False
        while True:
            # Rank again when the ranking is used up, or when what is left belongs to less
            # crowded addresses than those ranked first: newcomers admitted since (they
            # displaced the ones ranked) may have made those addresses the most crowded again.
            if not ranked and (not self._ranking or self._ranking[-1][2] < self._top):
                if now < self._rank_again_at:
                    return False
                self._rank(now)
                ranked = True
            if not self._ranking:
                self._rank_again_at = now + NOTHING_IDLE_RETRY_S
                return False
            occupant, since, _ = self._ranking.pop()
            if occupant.idle_since(now) == since:  # still idle, and not busy in between
                occupant.displace()
                self.counters["connections_displaced"] += 1
                return True
            # Stale: it closed or got busy, and so may others (an idle sweep closes many at
            # once): what is left no longer says who is idlest on the most crowded address.
            if not ranked:
                self._ranking = []

    def _rank(self, now: float) -> None:
        per_address = self.state.connections_per_address
        ranked: list[tuple[int, float, Occupant]] = []
        occupants: list[Occupant] = [*self.state.connections, *self.state.handshakes]
        for occupant in occupants:
            since = occupant.idle_since(now)
            if since is not None:
                held = per_address[occupant.address] if occupant.address is not None else 0
                ranked.append((held, since, occupant))
        ranked.sort(key=lambda row: (row[0], -row[1]))  # the most crowded address, longest idle: last
        self._ranking = [(occupant, since, held) for held, since, occupant in ranked]
        self._top = ranked[-1][0] if ranked else 0
        self._ranked_at = now

    # -- TLS handshakes --------------------------------------------------------------------

    def handshake(
        self, sock: socket.socket, peername: Any, context: ssl.SSLContext, connection: Connection
    ) -> None:
        """Start the TLS handshake of an admitted socket, to be served by ``connection``;
        the handshake holds the slot meanwhile."""
        loop = asyncio.get_running_loop()
        pending = PendingHandshake(address_of(peername), loop.time(), sock, self.state.handshakes)
        connection.handshake = pending
        pending.task = loop.create_task(self._handshake(pending, peername, context, connection))
        pending.task.add_done_callback(functools.partial(self._handshake_done, pending))

    async def _handshake(
        self, pending: PendingHandshake, peername: Any, context: ssl.SSLContext, connection: Connection
    ) -> None:
        sock, pending.sock = pending.sock, None  # the loop closes it from here on, whatever happens
        assert sock is not None
        try:
            await asyncio.get_running_loop().connect_accepted_socket(
                lambda: cast(asyncio.BaseProtocol, connection),
                sock,
                ssl=context,
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
            )
        except Exception as exc:  # a peer that is not a TLS client, or gave up: its business
            self.counters["tls_handshake_failures"] += 1
            log.debug("TLS handshake failed", peer=peername, error=repr(exc))
            # The traceback's frames reference the failed transport and the future that
            # carried this exception: a cycle that would keep the SSL object (and its
            # buffers) until the cyclic GC runs. Clearing the frames frees them now.
            traceback.clear_frames(exc.__traceback__)

    def _handshake_done(self, pending: PendingHandshake, task: asyncio.Task[None]) -> None:
        """Runs however the handshake ended: failed, timed out, displaced (even before it
        began), the server stopping, or done (the connection holds the slot then)."""
        if pending.sock is not None:
            pending.sock.close()  # cancelled before it began: the loop never had the socket
        if not pending.handed_over:
            self.state.handshakes.discard(pending)
            self.state.release_address(pending.address)

    async def close(self) -> None:
        """Stop every handshake in progress (the server is stopping), and wait until they
        have: the loop then owns no socket of theirs when it closes."""
        pending = list(self.state.handshakes)
        for handshake in pending:
            handshake.displace()
        await asyncio.gather(*(h.task for h in pending if h.task is not None), return_exceptions=True)
