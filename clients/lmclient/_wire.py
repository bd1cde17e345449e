"""Sans-IO halves of a connection: buffers to send, and replies read as a generator.

Strategy: reading a reply is written once, as a generator that yields the memoryview it
wants filled and is sent back how many bytes the socket put there (0 = end of stream).
`Client` drives it with ``sock.recv_into``, `AsyncClient` with a non-blocking ``recv_into``
plus ``loop.add_reader``; everything else (staging, draining, where a body lands) is here.

Headers and small bodies arrive through a staging buffer (the `Inbox`), several per
receive when requests are pipelined; a large body is received straight into its final
buffer (the caller's, for ``get_into``), never through the staging buffer.
"""

from __future__ import annotations

import os
import select
import socket
import sys
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, Protocol

from lmproto import REPLY_SIZE, Generation, RemoteProtocolError, Reply, Status, decode_reply

from ._exceptions import InvalidRequest, LMClientError, ProtocolError, ReadError

INBOX_SIZE = 64 * 1024
"""Staging buffer per connection: holds ~1,800 pipelined v1 reply headers."""

SMALL_BODY = 16 * 1024
"""Bodies (or body remainders) up to this size are read through the staging buffer, so
the replies pipelined behind them come in the same receive."""


def _iov_max() -> int:
    """Most buffers one ``sendmsg`` call accepts (1024 on Linux)."""
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 1024


IOV_MAX = _iov_max()


class HasFileno(Protocol):
    def fileno(self) -> int: ...


Sink = Callable[[Reply], "memoryview | LMClientError"]
"""Where a successful reply's body goes: a writable byte view of at least ``reply.length``
bytes, or the error to raise once the body has been read and dropped."""

ReadFlow = Generator[memoryview, int, "Received"]


class Received(NamedTuple):
    """One reply, fully read. ``body`` is None when the sink refused it (``refusal``)."""

    reply: Reply
    body: memoryview | None
    refusal: LMClientError | None = None


def fresh_sink(reply: Reply) -> memoryview:
    return memoryview(bytearray(reply.length))


# ---------------------------------------------------------------------------------------
# buffers


def readable_view(data: Any) -> memoryview:
    """A flat byte view of ``data`` (bytes-like, numpy array, CPU torch tensor), no copy."""
    return _byte_view(data, writable=False)


def writable_view(buffer: Any) -> memoryview:
    """A flat writable byte view of ``buffer``, no copy; refuses read-only buffers."""
    return _byte_view(buffer, writable=True)


def _byte_view(obj: Any, *, writable: bool) -> memoryview:
    if isinstance(obj, str):
        raise InvalidRequest("expected a bytes-like object, not str (encode it first)")
    try:
        view = memoryview(obj)
    except TypeError:
        torch = sys.modules.get("torch")
        if torch is None or not isinstance(obj, torch.Tensor):
            raise InvalidRequest(f"{type(obj).__name__} does not expose a buffer") from None
        from ._tensor import tensor_bytes

        view = tensor_bytes(obj)
    if writable and view.readonly:
        raise InvalidRequest(f"{type(obj).__name__} buffer is read-only")
    if not view.c_contiguous:
        raise InvalidRequest("buffer is not contiguous")
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B")


def advance(buffers: Sequence[memoryview], sent: int) -> list[memoryview]:
    """What remains of ``buffers`` after ``sendmsg`` sent ``sent`` bytes of them."""
    first = 0
    while first < len(buffers) and sent >= len(buffers[first]):
        sent -= len(buffers[first])
        first += 1
    rest = list(buffers[first:])
    if sent:
        rest[0] = rest[0][sent:]
    return rest


def tune(sock: socket.socket, unacknowledged_s: float) -> None:
    """Set up a connected socket: ``TCP_NODELAY`` (requests go out at once), and, where the
    OS has it, ``TCP_USER_TIMEOUT``: bytes the server has not acknowledged for
    ``unacknowledged_s`` (the connect timeout) mean its host is unreachable (a cut link, a
    machine gone), so the connection fails then, as a timeout, instead of after the read
    timeout, which is for a server that is slow to answer (it still acknowledges)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    user_timeout = getattr(socket, "TCP_USER_TIMEOUT", None)
    if user_timeout is not None:
        sock.setsockopt(socket.IPPROTO_TCP, user_timeout, max(1, round(unacknowledged_s * 1000)))


def readable_now(sock: socket.socket | HasFileno) -> bool:
    """Whether an idle connection has something to read: the server closed it (EOF or
    reset) or sent bytes nobody asked for; either way it must not be reused."""
    try:
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(sock, select.POLLIN)
            return bool(poller.poll(0))
        return bool(select.select([sock], [], [], 0)[0])
    except (OSError, ValueError):
        return True


# ---------------------------------------------------------------------------------------
# replies


class Inbox:
    """A connection's receive staging buffer: bytes ``[start, end)`` are read, not used."""

    __slots__ = ("buf", "end", "start", "view")

    def __init__(self, size: int = INBOX_SIZE) -> None:
        self.buf = bytearray(size)
        self.view = memoryview(self.buf)
        self.start = 0
        self.end = 0

    @property
    def available(self) -> int:
        return self.end - self.start

    def space(self) -> memoryview:
        """Free room to receive into, after moving unread bytes to the front if need be."""
        if self.start == self.end:
            self.start = self.end = 0
        elif len(self.buf) - self.end < SMALL_BODY:
            left = self.end - self.start
            self.view[:left] = self.view[self.start : self.end]  # memmove: overlap is fine
            self.start, self.end = 0, left
        return self.view[self.end :]

    def filled(self, count: int) -> None:
        """``count`` bytes were received into the view `space` returned."""
        self.end += _got(count)

    def take(self, target: memoryview) -> int:
        """Move up to ``len(target)`` staged bytes into ``target``; returns how many."""
        n = min(self.available, len(target))
        target[:n] = self.view[self.start : self.start + n]
        self.start += n
        return n

    def skip(self, count: int) -> int:
        n = min(self.available, count)
        self.start += n
        return n


def _got(n: int) -> int:
    if n == 0:
        raise ReadError("the server closed the connection")
    return n


def read_reply(inbox: Inbox, generation: Generation, sink: Sink, max_error_body: int) -> ReadFlow:
    """Read one reply header and its body; see the module docstring for the protocol.

    A successful reply's body goes where ``sink`` says; any other reply's body (an error
    text) into a fresh buffer of at most ``max_error_body`` bytes.
    """
    size = REPLY_SIZE[generation]
    while inbox.available < size:
        inbox.filled((yield inbox.space()))
    try:
        reply = decode_reply(inbox.buf, generation, inbox.start)
    except RemoteProtocolError as exc:
        raise ProtocolError(str(exc)) from exc
    inbox.start += size
    if reply.status == Status.SUCCESS:
        target = sink(reply)
    elif reply.length <= max_error_body:
        target = fresh_sink(reply)
    else:
        raise ProtocolError(f"status {reply.status} announced a {reply.length}-byte body")
    if isinstance(target, LMClientError):
        yield from _drain(inbox, reply.length)
        return Received(reply, None, target)
    body = target[: reply.length]
    yield from _fill(inbox, body)
    return Received(reply, body)


def _fill(inbox: Inbox, body: memoryview) -> Generator[memoryview, int, None]:
    pos = inbox.take(body)
    while pos < len(body):
        if len(body) - pos <= SMALL_BODY:
            inbox.filled((yield inbox.space()))
            pos += inbox.take(body[pos:])
        else:
            pos += _got((yield body[pos:]))


def _drain(inbox: Inbox, count: int) -> Generator[memoryview, int, None]:
    count -= inbox.skip(count)
    while count:
        inbox.filled((yield inbox.space()))
        count -= inbox.skip(count)
