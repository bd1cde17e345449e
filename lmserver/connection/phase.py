"""Where a connection stands, named, and every "may it ...?" derived from it in one place.

Strategy (h11's ``_state.py``: everything that decides what a connection may do lives here):
a connection is in exactly one phase, read off its parts rather than kept in a variable that
could disagree with them:

* ``CLOSED``: it closed (or is lingering to close without a reset); nothing is served.
* ``WAITING``: an operation it awaits is in flight (a lower-tier read, a DELETE, a PUT waiting
  for memory or for a tier): parsing resumes when it is done.
* ``RECEIVING_BODY``: a body is arriving straight into its buffer.
* ``DISCARDING``: a refused body is being dropped as it arrives.
* ``READING_HEADERS``: between requests, or in the middle of one's header.

Two things stop a connection in any phase from parsing on, without changing its phase: its
replies are not being read (``write_paused``) and too many PUT_ACKs wait for the disk. And a
connection asked to stop (``closing``) finishes what it received, then closes.
"""

from __future__ import annotations

from typing import Final, final

from .replies import MAX_ACKS_IN_FLIGHT, Replies
from .staging import Staging

READING_HEADERS: Final = 0
RECEIVING_BODY: Final = 1
DISCARDING: Final = 2
WAITING: Final = 3
CLOSED: Final = 4
NAMES: Final = ("reading headers", "receiving a body", "discarding a body", "waiting", "closed")


@final
class Phase:
    """A connection's lifecycle flags, and the predicates the protocol, the sweep and
    admission ask. Attributes are set directly by the protocol; nothing else decides."""

    def __init__(self, staging: Staging, replies: Replies) -> None:
        self.staging = staging
        self.replies = replies
        self.busy = False  # an awaited operation is in flight
        self.closing = False  # asked to stop: finish what was received, then close
        self.closed = False

    @property
    def current(self) -> int:
        if self.closed:
            return CLOSED
        if self.busy:
            return WAITING
        if self.staging.body is not None:
            return RECEIVING_BODY
        if self.staging.discard_left:
            return DISCARDING
        return READING_HEADERS

    @property
    def name(self) -> str:
        return NAMES[self.current]

    def may_parse(self) -> bool:
        """Whether the next staged header may be served now (the hot loop asks per request)."""
        replies = self.replies
        return not (
            self.busy
            or replies.write_paused
            or self.closed
            or self.staging.body is not None
            or self.staging.discard_left
            or replies.acks_in_flight >= MAX_ACKS_IN_FLIGHT
        )

    def should_pause_reading(self) -> bool:
        """Whether the transport should stop reading: waiting for an operation or for the peer
        to read replies, too many PUT_ACKs in flight, or closing between requests."""
        replies = self.replies
        if self.busy or replies.write_paused or replies.acks_in_flight >= MAX_ACKS_IN_FLIGHT:
            return True
        return self.closing and self.current == READING_HEADERS

    def may_close(self) -> bool:
        """Asked to stop, and nothing is left to do: no request in progress, no answer held
        for a PUT_ACK, nothing unsent."""
        return (
            self.closing
            and self.current == READING_HEADERS
            and not self.replies.held
            and not self.replies.write_paused
        )

    def in_request(self) -> bool:
        """Whether a request is in progress on either side (its header or body arriving, an
        operation, replies unsent or held, PUT_ACKs in flight): not idle."""
        replies = self.replies
        return (
            self.current != READING_HEADERS
            or self.staging.end > self.staging.start
            or bool(replies.held)
            or replies.acks_in_flight > 0
            or replies.write_paused
        )

    def waiting_for_server(self) -> bool:
        """Whether the connection waits for the server itself (an operation, or a PUT_ACK's
        write), so its peer's silence is no timeout."""
        return self.busy or bool(self.replies.held)
