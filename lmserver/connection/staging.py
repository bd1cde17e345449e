"""Where a connection's incoming bytes go: the staging buffer, a body's own buffer, or nowhere.

Strategy (h11's ``ReceiveBuffer``, plus the zero-copy body):

* Headers (and the first bytes of bodies) are received into a staging buffer and parsed many
  per read, so a burst of pipelined small requests costs one wakeup. ``staging[start:end]``
  is what is received and not parsed yet.
* The rest of a body is received straight into the buffer it will be kept in (``body``): the
  socket may fill ``body[body_pos:body_limit]`` (a PUT's memory is charged as it arrives, so
  the limit grows, see the protocol). No copy after the kernel.
* A body the server refuses is dropped as it arrives (``discard_left``), so the stream stays
  framed and nothing is allocated for it.
* Staging buffers come from a shared free list; an idle connection gives its own back
  (``give``), so it holds none: a few KiB of Python objects, not 64 KiB.

No I/O here, and no knowledge of frames: ``tests/server/test_staging.py`` feeds it a byte at a
time.
"""

from __future__ import annotations

import mmap
from typing import Final, final

STAGING_SIZE: Final = 64 * 1024
"""Header staging buffer: holds ~400 pipelined requests; at most this much of a body is copied."""

STAGING_KEPT: Final = 64
"""Idle staging buffers kept on the shared free list (4 MiB); more are freed."""

HEADER_ROOM: Final = 512
"""Room a partial header needs at the buffer's end (a header is 158 or 186 bytes): past it,
the partial header moves to the front."""

EMPTY: Final = memoryview(b"")
"""An empty view: the staging view while no buffer is held, and a bodiless request's body."""
_NO_STAGING: Final = bytearray()  # what a connection holds while it has no staging buffer
_free_staging: list[mmap.mmap] = []  # shared by every connection (list ops are atomic)


@final
class Staging:
    """One connection's receive side. Attributes are read directly on the hot path."""

    def __init__(self) -> None:
        self.buffer: bytearray | mmap.mmap = _NO_STAGING  # taken from the free list when needed
        self.view = EMPTY
        self.start = 0  # staged bytes not yet parsed are buffer[start:end]
        self.end = 0
        self.discard_left = 0  # bytes of a refused body still to drop
        # A body received in place: the socket fills body[body_pos:body_limit].
        self.body: memoryview | None = None
        self.body_pos = 0
        self.body_limit = 0

    # -- where the next read goes ---------------------------------------------------------

    def get_buffer(self) -> memoryview:
        """What the socket reads into next."""
        body = self.body
        if body is not None:
            return body[self.body_pos : self.body_limit]
        if self.buffer is _NO_STAGING:  # not `not self.buffer`: a generic truth test per read
            self.take()
        if self.discard_left or not self.end:
            # Empty staging (always so while a body is dropped; usually so between
            # sequential requests): the whole view as it is, no slice to build per read.
            return self.view
        if self.start and self.end + HEADER_ROOM > STAGING_SIZE:
            # Move a partial header to the front so a whole one always fits.
            pending = self.end - self.start
            self.buffer[:pending] = self.view[self.start : self.end]
            self.start, self.end = 0, pending
        return self.view[self.end :]

    def received(self, nbytes: int) -> None:
        """``nbytes`` arrived in what ``get_buffer`` gave, outside a body."""
        if self.discard_left:
            dropped = min(nbytes, self.discard_left)
            self.discard_left -= dropped
            self.start, self.end = dropped, nbytes
            if not self.end > self.start:
                self.start = self.end = 0
        else:
            self.end += nbytes

    # -- parsing --------------------------------------------------------------------------

    @property
    def staged(self) -> int:
        """Bytes received and not parsed yet."""
        return self.end - self.start

    def consume(self, nbytes: int) -> None:
        """``nbytes`` of the staged bytes were parsed."""
        self.start += nbytes
        if self.start == self.end:
            self.start = self.end = 0

    def discard(self, nbytes: int) -> None:
        """Drop the next ``nbytes`` (a refused body): what is staged of them now, the rest as
        it arrives."""
        self.discard_left = nbytes
        dropped = min(self.end - self.start, nbytes)
        self.discard_left -= dropped
        self.consume(dropped)

    def drop_all(self) -> None:
        """Forget what is staged (the connection is closing, or closed)."""
        self.start = self.end = 0

    # -- bodies -----------------------------------------------------------------------------

    def begin_body(self, target: memoryview) -> int:
        """Start receiving a body into ``target``: first what is staged of it, copied; the
        rest straight from the socket (``body``). Returns how much was staged: the body is
        complete if that is ``len(target)``."""
        staged = min(self.end - self.start, len(target))
        if staged:
            target[:staged] = self.view[self.start : self.start + staged]
            self.consume(staged)
        if staged < len(target):
            self.body, self.body_pos, self.body_limit = target, staged, len(target)
        return staged

    def end_body(self) -> None:
        self.body = None

    # -- the buffer itself ----------------------------------------------------------------------

    def take(self) -> None:
        try:
            self.buffer = _free_staging.pop()
        except IndexError:
            # An mmap: its pages cost RSS only once touched (one, for a lone small request),
            # and a freed one goes back to the OS, not into malloc's heap.
            self.buffer = mmap.mmap(-1, STAGING_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.view = memoryview(self.buffer)

    def give(self) -> None:
        """Return the staging buffer to the free list (only while nothing is staged)."""
        if self.buffer is not _NO_STAGING and self.end == 0:
            if len(_free_staging) < STAGING_KEPT:
                _free_staging.append(self.buffer)  # type: ignore[arg-type]  # never _NO_STAGING
            self.buffer, self.view = _NO_STAGING, EMPTY

    @property
    def holding(self) -> int:
        """Bytes of staging buffer this connection holds now."""
        return len(self.buffer)

    def close(self) -> None:
        """The connection is gone: nothing staged or in a body matters any more."""
        self.body = None
        self.start = self.end = 0
        self.give()
