"""`Client`: the blocking client. Only socket I/O lives here; see _ops for the logic.

Strategy: a small pool of blocking sockets. A thread checks a connection out, runs one
batch on it (send everything, then read the replies in order) and checks it back in; a
connection that failed mid-exchange is closed instead, so a half-finished exchange is
never reused. An idle connection that has become readable (the server closed it, e.g. it
restarted) is dropped at checkout, before a fire-and-forget PUT could vanish into it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Coroutine, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from lmproto import MAX_CONTROL_BODY, MemoryFormat, ObjectMeta

from ._config import Settings
from ._exceptions import (
    CONNECT_ERRORS,
    READ_ERRORS,
    WRITE_ERRORS,
    PoolTimeout,
    map_exceptions,
)
from ._ops import BaseClient, Batch, Flow, Op, single
from ._tls import TLSSocket, wrap_blocking
from ._wire import IOV_MAX, Inbox, Received, advance, read_reply, readable_now

if TYPE_CHECKING:
    import torch

T = TypeVar("T")


def run_blocking(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine whose awaits never suspend (blocking I/O) to its end."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
    coro.close()
    raise RuntimeError("blocking client code suspended: it must not await real coroutines")


class _Connection:
    """One blocking socket; used by one thread at a time (the pool sees to that)."""

    def __init__(self, settings: Settings) -> None:
        timeout = settings.timeout
        self._sock: socket.socket | TLSSocket
        with map_exceptions(CONNECT_ERRORS):
            self._sock = socket.create_connection((settings.host, settings.port), timeout=timeout.connect)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if settings.ssl_context is not None:
                self._sock = wrap_blocking(self._sock, settings.ssl_context, settings.host)
        self._generation = settings.generation
        self._timeout = timeout
        self._inbox = Inbox()

    def close(self) -> None:
        self._sock.close()

    def dropped(self) -> bool:
        """Whether this idle connection has bytes nobody asked for, or an EOF: unusable."""
        return self._inbox.available > 0 or readable_now(self._sock)

    def exchange(self, batch: Batch) -> list[Received | None]:
        buffers = [buf for op in batch.ops for buf in op.buffers]
        self._sock.settimeout(self._timeout.write)
        with map_exceptions(WRITE_ERRORS):
            while buffers:
                buffers = advance(buffers, self._sock.sendmsg(buffers[:IOV_MAX]))
        self._sock.settimeout(batch.read_timeout or self._timeout.read)
        return [self._read(op) if op.expects_reply else None for op in batch.ops]

    def _read(self, op: Op[Any]) -> Received:
        flow = read_reply(self._inbox, self._generation, op.sink, MAX_CONTROL_BODY)
        with map_exceptions(READ_ERRORS):
            try:
                view = next(flow)
                while True:
                    view = flow.send(self._sock.recv_into(view))
            except StopIteration as stop:
                received: Received = stop.value
                return received


class _Pool:
    """At most ``max_connections`` connections, handed to one thread at a time.

    After a plain PUT, until a later reply on its connection confirms the server took it
    in, every thread waits for that connection (see ``Batch.leaves_put_unconfirmed``).
    """

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._idle: list[_Connection] = []
        self._sticky: _Connection | None = None  # holds a PUT the server has not confirmed
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self) -> _Connection:
        deadline = time.monotonic() + self._settings.timeout.pool
        with self._cond:
            while True:
                conn = self._take_idle()
                if conn is not None:
                    return conn
                if self._sticky is None and self._count < self._settings.max_connections:
                    self._count += 1
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise PoolTimeout(f"no free connection in {self._settings.timeout.pool}s")
        try:
            return _Connection(self._settings)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
            raise

    def _take_idle(self) -> _Connection | None:
        """An idle live connection: the one holding an unconfirmed PUT if there is one."""
        while True:
            if self._sticky is not None:
                if self._sticky not in self._idle:
                    return None  # busy: wait for it
                self._idle.remove(self._sticky)
                conn = self._sticky
            elif self._idle:
                conn = self._idle.pop()
            else:
                return None
            if not conn.dropped():
                return conn
            self._forget(conn)

    def release(self, conn: _Connection, unconfirmed_put: bool) -> None:
        with self._cond:
            if self._closed:  # the client was closed while this thread used it
                self._forget(conn)
                return
            if unconfirmed_put:
                self._sticky = conn
            elif self._sticky is conn:
                self._sticky = None
            self._idle.append(conn)
            self._cond.notify_all()

    def discard(self, conn: _Connection) -> None:
        with self._cond:
            self._forget(conn)
            self._cond.notify_all()

    def _forget(self, conn: _Connection) -> None:
        conn.close()
        self._count -= 1
        if self._sticky is conn:
            self._sticky = None  # its PUTs are lost with it: fire-and-forget

    def close(self) -> None:
        with self._cond:
            self._closed = True
            idle, self._idle = self._idle, []
            for conn in idle:
                self._forget(conn)
            self._cond.notify_all()


class Client(BaseClient):
    """Blocking lm:// client, safe to share between threads.

    ``Client(host, port, *, protocol="v1", timeout=Timeout(30, connect=5), retry=3,
    max_connections=4, exist_many="auto", probe_timeout=2.0)``; ``Client.from_url("lm://h:p")``.

    - ``protocol``: the frame generation, ``"v1"`` (default: what today's LMCache ``lm://``
      connector speaks, and the only one that carries tensor metadata) or ``"v0"`` (LMCache
      <= 0.3 servers). lmserver accepts both on one port.
    - ``timeout``: seconds, or a `Timeout` for connect/read/write/pool separately.
    - ``retry``: retries after a network error, or a `Retry` policy (backoff, timeouts).
    - ``max_connections``: sockets kept open for concurrent threads.
    - ``exist_many``: ``"auto"`` tries the EXIST_MANY extension once (bounded by
      ``probe_timeout``) and falls back to pipelined EXISTs if the server lacks it;
      ``"always"`` or ``"never"`` skip the probe.

    A plain PUT gets no reply, so until a later reply on its connection confirms it,
    every request goes to that connection (after the PUT, in order): reads see earlier
    writes. Acknowledged PUTs (``ack=True``) use the whole pool in parallel.
    """

    def _init_io(self) -> None:
        self._pool = _Pool(self._settings)

    def close(self) -> None:
        """Close every connection; the client cannot be used afterwards."""
        self._closed = True
        self._pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- I/O --------------------------------------------------------------------------

    def _drive(self, flow: Flow[T]) -> T:
        return run_blocking(self._call(flow))

    async def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)  # noqa: ASYNC251 - blocking by design, see run_blocking

    async def _exchange(self, batch: Batch) -> list[Received | None]:  # blocking
        self._check_open()
        conn = self._pool.acquire()
        try:
            received = conn.exchange(batch)
        except BaseException:
            self._pool.discard(conn)
            raise
        self._pool.release(conn, batch.leaves_put_unconfirmed)
        return received

    # -- commands ---------------------------------------------------------------------

    def put(self, key: str, data: Any, *, meta: ObjectMeta | None = None, ack: bool = False) -> None:
        """Store ``data`` (any bytes-like object, numpy array or CPU tensor) under ``key``.

        Without ``ack`` this is upstream's fire-and-forget PUT: nothing comes back, so a
        refusal (no space, too large) goes unnoticed. ``ack=True`` sends PUT_ACK (an
        lmserver extension) and raises `ServerError` unless the object was stored.
        ``meta`` (v1 only) is stored with the object and returned by `get_with_meta`.
        """
        self._drive(single(self._commands.put(key, data, meta, ack)))

    def get(self, key: str) -> bytes | None:
        """The object under ``key``, or None on a miss. (`get_into` avoids the copy.)"""
        return self._drive(single(self._commands.get(key)))

    def get_with_meta(self, key: str) -> tuple[bytes, ObjectMeta] | None:
        """The object and its v1 metadata (`lmproto.NO_META` over v0), or None on a miss."""
        return self._drive(single(self._commands.get_with_meta(key)))

    def get_into(self, key: str, buffer: Any) -> int | None:
        """Receive the object straight into ``buffer``; returns its length, None on a miss.

        ``buffer`` is any writable contiguous buffer: bytearray, memoryview, numpy array,
        CPU torch tensor. An object larger than it raises `BufferTooSmall` (the buffer is
        left untouched and the connection stays usable).
        """
        return self._drive(single(self._commands.get_into(key, buffer)))

    def exists(self, key: str) -> bool:
        return self._drive(single(self._commands.exists(key)))

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        """Presence of each key, in order: one EXIST_MANY round trip where the server has
        it, else EXISTs pipelined on one connection. See ``lmproto.hit_prefix``."""
        return self._drive(self._exists_many_flow(keys))

    def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was not there (lmserver extension)."""
        return self._drive(single(self._commands.delete(key)))

    def health(self) -> bool:
        """True if the server answers HEALTH with success within ``probe_timeout``; False
        if it answers otherwise (e.g. while draining), too late, or cannot be reached."""
        return self._drive(self._health_flow())

    def stats(self) -> dict[str, Any]:
        """The server's counters as a dict (lmserver extension)."""
        return self._drive(single(self._commands.stats()))

    def put_tensor(
        self, key: str, tensor: torch.Tensor, *, fmt: int = MemoryFormat.UNDEFINED, ack: bool = False
    ) -> None:
        """Store a CPU contiguous tensor with its dtype and shape (<= 4 dims) as v1 metadata."""
        self._drive(single(self._put_tensor_op(key, tensor, fmt, ack)))

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """A new tensor of the stored dtype and shape, received in place; None on a miss."""
        return self._drive(single(self._get_tensor_op(key, None)))

    def get_tensor_into(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Receive into ``tensor``, which must have the stored dtype and shape (else
        `TensorMismatch`, with ``tensor`` untouched). Returns ``tensor``; None on a miss."""
        return self._drive(single(self._get_tensor_op(key, tensor)))

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` (the server may cap how many it sends)."""
        return self._drive(single(self._commands.list(prefix)))
