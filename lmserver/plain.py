"""The transport of plain TCP connections: the connection's socket read and written here, the
event loop only saying when it is ready (``add_reader``/``add_writer``).

Why not the loop's own transport: a small request is mostly fixed costs, and uvloop's stream
transport spends ~2,600 instructions per read around our code (of ~6,600 for a sequential
EXIST, whole process: callgrind, ``python -m bench.instructions --servers``). It makes two
callbacks per read, ``get_buffer`` and ``buffer_updated``, each taking the GIL and entering the
protocol's context, and acquires the buffer through the buffer protocol in between. Here one
readiness callback (compiled, like the protocol) asks the protocol for its buffer, reads into
it with one ``recv(2)`` that keeps the GIL (``recv_nowait``, C) and hands the count on. uvloop
also forbids ``add_reader`` on the descriptor of its own transports, so this is all or nothing.

What the protocol sees is asyncio's ``BufferedProtocol`` contract, as the stdlib's and uvloop's
transports keep it: ``connection_made``, ``get_buffer``/``buffer_updated``, ``eof_received``
(the connection is closed unless it returns true), ``pause_writing``/``resume_writing``
around the write-buffer limits, and ``connection_lost`` once, after which the socket is
closed. Writes are not copied: the transport keeps a reference to what it could not send, as
uvloop's does (the connection pins an object until ``get_write_buffer_size()`` is 0).
Exceptions from the protocol are reported to the loop's exception handler and close the
connection, as both loops do; a socket error closes it quietly (logged at debug).

TLS connections keep the loop's transport (server.py): the TLS layer is its business.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Final

import structlog

from ._framed import recv_nowait

log = structlog.get_logger("lmserver.plain")

READS_PER_EVENT: Final = 32
"""Reads per readiness callback while each fills the buffer it was given (libuv reads as many):
a large body arrives in few callbacks, and one connection cannot keep the loop to itself."""

IOV_MAX: Final = 1024
"""Buffers per ``sendmsg`` (Linux's limit)."""

ACCEPT_RETRY_S: Final = 1.0
"""Out of descriptors or memory, accepting pauses this long (asyncio's delay)."""

_recv_nowait: Final = recv_nowait  # compiled, a Final is a C static: no module dict lookup per read

_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


class Receiver(asyncio.BufferedProtocol):
    """What a PlainTransport delivers to: a BufferedProtocol whose methods it calls directly
    (compiled, a native call, where an ``asyncio.BufferedProtocol`` would take a generic one
    per read). ``LMProtocol`` is one; naming the base here keeps this module free of it."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        raise NotImplementedError

    def get_buffer(self, sizehint: int) -> memoryview:
        raise NotImplementedError

    def buffer_updated(self, nbytes: int) -> None:
        raise NotImplementedError

    def eof_received(self) -> bool:
        raise NotImplementedError

    def pause_writing(self) -> None:
        raise NotImplementedError

    def resume_writing(self) -> None:
        raise NotImplementedError

    def connection_lost(self, exc: Exception | None) -> None:
        raise NotImplementedError


class PlainTransport:
    """One accepted TCP connection. The subset of ``asyncio.Transport`` the server uses."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        peername: Any,
        protocol: Receiver,
    ) -> None:
        self._loop = loop
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._extra: dict[str, Any] = {"socket": sock, "peername": peername, "sockname": sock.getsockname()}
        self._unsent: deque[bytes | memoryview] = deque()
        self._unsent_bytes = 0
        self._high = 64 * 1024
        self._low = 16 * 1024
        self._protocol_paused = False  # pause_writing called, resume_writing not yet
        self._reading = False  # registered with add_reader
        self._read_wanted = True  # the protocol has not paused reading
        self._at_eof = False  # the peer's end of stream was read
        self._writer = False  # registered with add_writer
        self._closing = False  # close() or abort(): nothing more is read
        self._eof_wanted = False  # write_eof(): shut down writing once everything is sent
        self._lost = False  # connection_lost is scheduled: nothing more is written either

    def start(self) -> None:
        try:
            self._protocol.connection_made(self)  # type: ignore[arg-type]  # duck-typed Transport
        except Exception as exc:
            self._fatal(exc, "connection_made")
            return
        self._start_reading()

    # -- asyncio.BaseTransport ---------------------------------------------------------------

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._extra.get(name, default)

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        """Stop reading; close once everything written is sent."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._unsent:
            self._schedule_lost(None)

    def abort(self) -> None:
        """Close now, dropping what is not sent yet."""
        self._force_close(None)

    # -- reading ------------------------------------------------------------------------------

    def pause_reading(self) -> None:
        self._read_wanted = False
        self._stop_reading()

    def resume_reading(self) -> None:
        self._read_wanted = True
        self._start_reading()

    def is_reading(self) -> bool:
        return self._reading

    def _start_reading(self) -> None:
        if self._reading or not self._read_wanted or self._closing or self._at_eof:
            return
        self._reading = True
        self._loop.add_reader(self._fd, self._on_readable)

    def _stop_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._loop.remove_reader(self._fd)

    def _on_readable(self) -> None:
        protocol = self._protocol
        # A named counter, not `_`: compiled, mypyc gave `_` an object type here and boxed the
        # loop's int into it on every pass.
        for _read in range(READS_PER_EVENT):
            try:
                view = protocol.get_buffer(-1)
            except Exception as exc:
                self._fatal(exc, "get_buffer")
                return
            try:
                got = _recv_nowait(self._fd, view)
            except ValueError as exc:  # an empty buffer: the protocol's error, as uvloop has it
                self._fatal(exc, "get_buffer")
                return
            except OSError as exc:
                self._fatal(exc, "recv")
                return
            if got < 0:
                return
            if got == 0:
                self._on_eof()
                return
            try:
                protocol.buffer_updated(got)
            except Exception as exc:
                self._fatal(exc, "buffer_updated")
                return
            if got < len(view) or not self._reading:
                return

    def _on_eof(self) -> None:
        self._at_eof = True
        self._stop_reading()
        try:
            keep_open = self._protocol.eof_received()
        except Exception as exc:
            self._fatal(exc, "eof_received")
            return
        if not keep_open:
            self.close()

    # -- writing ------------------------------------------------------------------------------

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        """asyncio's rule: ``high`` defaults to 64 KiB, ``low`` to a quarter of ``high``."""
        if high is None:
            high = 64 * 1024 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low
        self._maybe_pause_protocol()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_write_buffer_size(self) -> int:
        return self._unsent_bytes

    def write(self, data: bytes | memoryview) -> None:
        self._queue([data])

    def writelines(self, list_of_data: Any) -> None:
        self._queue(list(list_of_data))

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Shut down our side of the stream after what is written so far."""
        if self._eof_wanted or self._closing:
            return
        self._eof_wanted = True
        if not self._unsent:
            self._shutdown_writing()

    def _queue(self, pieces: list[bytes | memoryview]) -> None:
        if self._eof_wanted:
            raise RuntimeError("write after write_eof()")
        if self._lost:
            return  # aborted or lost: asyncio drops such writes too
        for piece in pieces:
            size = memoryview(piece).nbytes
            if size:
                self._unsent.append(piece)
                self._unsent_bytes += size
        if not self._unsent:
            return
        if not self._writer:  # else the socket is full: the writer sends it in turn
            self._send_unsent()
            if not self._unsent or self._lost:
                return
            self._writer = True
            self._loop.add_writer(self._fd, self._on_writable)
        self._maybe_pause_protocol()

    def _send_unsent(self) -> None:
        """Send what the socket takes now, oldest first."""
        unsent = self._unsent
        while unsent:
            batch = list(itertools.islice(unsent, IOV_MAX))
            try:
                sent = self._sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._fatal(exc, "send")
                return
            self._unsent_bytes -= sent
            while sent:
                size = memoryview(unsent[0]).nbytes
                if sent < size:
                    unsent[0] = memoryview(unsent[0]).cast("B")[sent:]
                    return  # the socket took part of a piece: it is full
                unsent.popleft()
                sent -= size

    def _on_writable(self) -> None:
        self._send_unsent()
        if self._unsent or self._lost:
            return
        self._writer = False
        self._loop.remove_writer(self._fd)
        self._maybe_resume_protocol()  # may write again
        if self._unsent:
            return
        if self._closing:
            self._schedule_lost(None)
        elif self._eof_wanted:
            self._shutdown_writing()

    def _shutdown_writing(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError as exc:
            log.debug("shutdown failed", error=repr(exc))

    def _maybe_pause_protocol(self) -> None:
        if self._unsent_bytes > self._high and not self._protocol_paused:
            self._protocol_paused = True
            try:
                self._protocol.pause_writing()
            except Exception as exc:
                self._fatal(exc, "pause_writing")

    def _maybe_resume_protocol(self) -> None:
        if self._protocol_paused and self._unsent_bytes <= self._low:
            self._protocol_paused = False
            try:
                self._protocol.resume_writing()
            except Exception as exc:
                self._fatal(exc, "resume_writing")

    # -- closing ------------------------------------------------------------------------------

    def _fatal(self, exc: BaseException, where: str) -> None:
        if isinstance(exc, OSError):
            log.debug("connection error", where=where, error=repr(exc), peer=self._extra["peername"])
        else:
            self._loop.call_exception_handler(
                {
                    "message": f"Fatal error on transport ({where})",
                    "exception": exc,
                    "transport": self,
                    "protocol": self._protocol,
                }
            )
        self._force_close(exc if isinstance(exc, Exception) else None)

    def _force_close(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._closing = True
        self._stop_reading()
        if self._writer:
            self._writer = False
            self._loop.remove_writer(self._fd)
        self._unsent.clear()
        self._unsent_bytes = 0
        self._schedule_lost(exc)

    def _schedule_lost(self, exc: Exception | None) -> None:
        if not self._lost:
            self._lost = True
            self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: Exception | None) -> None:
        try:
            self._protocol.connection_lost(exc)
        finally:
            self._sock.close()


Accepted = Callable[[socket.socket, Any], None]
"""What a listener does with each accepted socket (non-blocking by then) and its peer's address:
admit and serve it, or close it. It owns the socket from then on."""


class PlainListener:
    """Listening sockets whose accepted connections go to ``accepted``: the subset of
    ``asyncio.Server`` the server uses (``sockets``, ``close``, ``wait_closed``). The server
    admits each connection there (admission.py) before a byte is read or a TLS handshake
    begins, and serves it on a ``PlainTransport`` or hands it to the loop's TLS layer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sockets: list[socket.socket],
        accepted: Accepted,
        backlog: int,
    ) -> None:
        self._loop = loop
        self.sockets = list(sockets)
        self._accepted = accepted
        self._backlog = backlog
        self._accepting = False
        self._closed = False

    def start(self) -> None:
        for sock in self.sockets:
            sock.listen(self._backlog)
        self._resume_accepting()

    def close(self) -> None:
        """Stop accepting; open connections stay (the server closes them)."""
        if self._closed:
            return
        self._pause_accepting()
        self._closed = True
        for sock in self.sockets:
            sock.close()
        self.sockets = []

    async def wait_closed(self) -> None:
        return None

    def _resume_accepting(self) -> None:
        if not self._closed and not self._accepting:
            self._accepting = True
            for sock in self.sockets:
                self._loop.add_reader(sock.fileno(), self._on_acceptable, sock)

    def _pause_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            for sock in self.sockets:
                self._loop.remove_reader(sock.fileno())

    def _on_acceptable(self, sock: socket.socket) -> None:
        for _ in range(self._backlog):
            try:
                conn, peername = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # the peer gave up while queued
            except OSError as exc:
                if exc.errno not in _OUT_OF_RESOURCES:
                    log.warning("accept failed", error=repr(exc))  # as asyncio: logged, go on
                    return
                log.error("accept failed, pausing", error=repr(exc), retry_s=ACCEPT_RETRY_S)
                self._pause_accepting()
                self._loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            try:
                conn.setblocking(False)
                self._accepted(conn, peername)
            except Exception as exc:  # the connection reset already (getsockname), or a bug
                log.warning("accepted connection dropped", error=repr(exc), peer=peername)
                conn.close()
                continue
            if self._closed:
                return


async def listen(host: str, port: int, accepted: Accepted, *, backlog: int) -> PlainListener:
    """Listen on every address ``host`` resolves to, at ``port`` (0: a free one), with
    ``SO_REUSEADDR`` and IPv6 sockets IPv6-only, as ``loop.create_server`` does."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as exc:
                message = f"error while attempting to bind on address {address!r}: {exc.strerror}"
                raise OSError(exc.errno, message) from None
            sock.setblocking(False)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    listener = PlainListener(loop, sockets, accepted, backlog)
    listener.start()
    return listener


async def create_plain_server(
    protocol_factory: Callable[[], Receiver], host: str, port: int, *, backlog: int
) -> PlainListener:
    """``listen`` serving every accepted connection with a new protocol, no questions asked."""
    loop = asyncio.get_running_loop()

    def accepted(sock: socket.socket, peername: Any) -> None:
        PlainTransport(loop, sock, peername, protocol_factory()).start()

    return await listen(host, port, accepted, backlog=backlog)
