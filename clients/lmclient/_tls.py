"""TLS for both clients (``lms://host:port`` or ``ssl=``), as a socket with the calls they use.

Strategy: the clients are written against a plain socket's non-blocking contract
(``sendmsg``/``recv_into``, ``BlockingIOError`` when the kernel is not ready). `TLSSocket`
keeps that contract over an `ssl.SSLSocket`:

* want-read / want-write become ``BlockingIOError``, so the asyncio client waits for the
  descriptor and retries. That is correct for reads because a read is always *tried* before
  waiting: decrypted bytes buffered inside OpenSSL are returned first, and want-read means
  the kernel itself has nothing.
* ``sendmsg`` (which SSLSocket lacks) sends one chunk: a large buffer (an object body) as is,
  encrypted straight from the caller's memory; runs of small buffers (headers, small bodies)
  joined first, so pipelined requests still leave in a few TLS records. OpenSSL requires a
  write that wanted to wait to be retried with the same bytes, so that chunk is kept and
  retried; callers only ever append to what they have not sent, so it is still their head.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Sequence

from ._exceptions import InvalidRequest

SslOption = ssl.SSLContext | bool | None
"""``ssl=``: a context (your CA, client certificate), True (the system's CAs), None/False (plain)."""

SMALL = 16 * 1024
"""Buffers below this are joined with their neighbours into one chunk (at most COALESCE)."""

COALESCE = 64 * 1024


def client_context(option: SslOption) -> ssl.SSLContext | None:
    if option is None or option is False:
        return None
    if option is True:
        return ssl.create_default_context()
    if isinstance(option, ssl.SSLContext):
        return option
    raise InvalidRequest(f"ssl must be an ssl.SSLContext, True or None, not {option!r}")


class TLSSocket:
    """An `ssl.SSLSocket` speaking the plain non-blocking socket contract (module docstring)."""

    def __init__(self, sock: ssl.SSLSocket) -> None:
        self._sock = sock
        self._retry: bytes | memoryview | None = None  # a chunk OpenSSL must see again

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def settimeout(self, timeout: float | None) -> None:
        self._sock.settimeout(timeout)

    def setsockopt(self, level: int, option: int, value: int) -> None:
        self._sock.setsockopt(level, option, value)

    def sendmsg(self, buffers: Sequence[bytes | memoryview]) -> int:
        chunk = self._retry if self._retry is not None else _first_chunk(buffers)
        try:
            sent = self._sock.send(chunk)
        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
            self._retry = chunk
            raise BlockingIOError("TLS write must wait") from None
        self._retry = None
        return sent

    def recv_into(self, view: memoryview) -> int:
        try:
            return self._sock.recv_into(view)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise BlockingIOError("TLS read must wait") from None


def _first_chunk(buffers: Sequence[bytes | memoryview]) -> bytes | memoryview:
    if len(buffers[0]) >= SMALL:
        return buffers[0]
    end, total = 0, 0
    while end < len(buffers) and len(buffers[end]) < SMALL and total + len(buffers[end]) <= COALESCE:
        total += len(buffers[end])
        end += 1
    return buffers[0] if end == 1 else b"".join(buffers[:end])


def wrap_blocking(sock: socket.socket, context: ssl.SSLContext, host: str) -> TLSSocket:
    """Handshake on a connected blocking socket (bounded by its timeout)."""
    return TLSSocket(context.wrap_socket(sock, server_hostname=host))


async def wrap_nonblocking(sock: socket.socket, context: ssl.SSLContext, host: str) -> TLSSocket:
    """Handshake on a connected non-blocking socket, waiting on the event loop (the caller
    bounds the time). Works on any loop: only ``add_reader``/``add_writer`` are used."""
    loop = asyncio.get_running_loop()
    tls = context.wrap_socket(sock, server_hostname=host, do_handshake_on_connect=False)
    try:
        while True:
            try:
                tls.do_handshake()
                return TLSSocket(tls)
            except ssl.SSLWantReadError:
                await _ready(loop, tls.fileno(), write=False)
            except ssl.SSLWantWriteError:
                await _ready(loop, tls.fileno(), write=True)
    except BaseException:
        tls.close()
        raise


async def _ready(loop: asyncio.AbstractEventLoop, fd: int, *, write: bool) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    (loop.add_writer if write else loop.add_reader)(fd, wake)
    try:
        await ready
    finally:
        (loop.remove_writer if write else loop.remove_reader)(fd)
