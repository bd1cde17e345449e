"""`Client`: the blocking client. Only socket I/O lives here; see _ops for the logic.

Strategy: per server, one blocking socket per lane (see _placement). A thread checks a
lane out (a key's lane, or any free one for commands on no key), runs one batch on it
(send everything, then read the replies in order) and checks it back in; a connection
that failed mid-exchange is closed instead, so a half-finished exchange is never reused.
An idle connection that has become readable (the server closed it, e.g. it restarted) is
dropped at checkout, before a fire-and-forget PUT could vanish into it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Coroutine, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, overload

from lmproto import MAX_CONTROL_BODY, MemoryFormat, ObjectMeta

from ._config import Settings, wait_limit
from ._exceptions import (
    CONNECT_ERRORS,
    READ_ERRORS,
    WRITE_ERRORS,
    ConnectTimeout,
    LMClientError,
    PoolTimeout,
    ReadTimeout,
    WriteTimeout,
    map_exceptions,
)
from ._ops import BaseClient, Batch, Flow, Op, Page
from ._placement import Address
from ._tls import TLSSocket, wrap_blocking
from ._wire import IOV_MAX, Inbox, Received, advance, read_reply, readable_now, tune

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
    """One blocking socket; used by one thread at a time (the pool sees to that). Every
    wait is cut to what is left of the call's deadline (`wait_limit`)."""

    def __init__(self, settings: Settings, address: Address, deadline: float) -> None:
        timeout = settings.timeout
        self._sock: socket.socket | TLSSocket
        limit = wait_limit(deadline, timeout.connect, ConnectTimeout)
        with map_exceptions(CONNECT_ERRORS):
            self._sock = socket.create_connection(address, timeout=limit)
            tune(self._sock, timeout.connect)
            if settings.ssl_context is not None:
                self._sock = wrap_blocking(self._sock, settings.ssl_context, address.host)
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
        deadline = batch.deadline
        with map_exceptions(WRITE_ERRORS):
            while buffers:
                self._sock.settimeout(wait_limit(deadline, self._timeout.write, WriteTimeout))
                buffers = advance(buffers, self._sock.sendmsg(buffers[:IOV_MAX]))
        limit = batch.read_timeout or self._timeout.read
        return [self._read(op, limit, deadline) if op.expects_reply else None for op in batch.ops]

    def _read(self, op: Op[Any], limit: float, deadline: float) -> Received:
        flow = read_reply(self._inbox, self._generation, op.sink, MAX_CONTROL_BODY)
        sock = self._sock
        with map_exceptions(READ_ERRORS):
            try:
                view = next(flow)
                while True:
                    sock.settimeout(wait_limit(deadline, limit, ReadTimeout))
                    view = flow.send(sock.recv_into(view))
            except StopIteration as stop:
                received: Received = stop.value
                return received


class _Pool:
    """One server's connections: one per lane, each used by one thread at a time.

    A request on a key waits for its key's lane (see _placement), so a key's requests
    reach the server in the caller's order; a request on no key takes any free lane.
    """

    def __init__(self, settings: Settings, address: Address) -> None:
        self._settings = settings
        self._address = address
        lanes = settings.max_connections
        self._conns: list[_Connection | None] = [None] * lanes
        self._busy = [False] * lanes
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self, lane: int | None, call_deadline: float) -> tuple[int, _Connection]:
        """A lane's live connection, opened if need be; the lane is this thread's until
        `release` or `discard`."""
        start = time.monotonic()
        deadline = min(start + self._settings.timeout.pool, call_deadline)
        with self._cond:
            while True:
                chosen = self._free(lane)
                if chosen is not None:
                    self._busy[chosen] = True
                    conn = self._conns[chosen]
                    break
                left = deadline - time.monotonic()
                if left <= 0 or not self._cond.wait(left):
                    raise PoolTimeout(f"no free connection in {deadline - start:.3g}s")
        try:
            if conn is not None and conn.dropped():
                conn.close()
                conn = None
            if conn is None:
                conn = _Connection(self._settings, self._address, call_deadline)
        except BaseException:
            with self._cond:
                self._conns[chosen] = None
                self._busy[chosen] = False
                self._cond.notify_all()
            raise
        return chosen, conn

    def _free(self, lane: int | None) -> int | None:
        if lane is not None:
            return None if self._busy[lane] else lane
        idle = [i for i, busy in enumerate(self._busy) if not busy]
        opened = [i for i in idle if self._conns[i] is not None]
        candidates = opened or idle
        return candidates[0] if candidates else None

    def open_lanes(self) -> list[int]:
        with self._cond:
            return [i for i, conn in enumerate(self._conns) if conn is not None]

    def release(self, lane: int, conn: _Connection) -> None:
        with self._cond:
            if self._closed:  # the client was closed while this thread used it
                conn.close()
            self._conns[lane] = None if self._closed else conn
            self._busy[lane] = False
            self._cond.notify_all()

    def discard(self, lane: int, conn: _Connection) -> None:
        conn.close()
        with self._cond:
            self._conns[lane] = None
            self._busy[lane] = False
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            for lane, conn in enumerate(self._conns):
                if conn is not None and not self._busy[lane]:
                    conn.close()
                    self._conns[lane] = None
            self._cond.notify_all()


class Client(BaseClient):
    """Blocking lm:// client, safe to share between threads.

    ``Client(host, port, *, protocol="v1", timeout=Timeout(30, connect=5), retry=3,
    max_connections=4, exist_many="auto", probe_timeout=2.0)``; ``Client.from_url("lm://h:p")``.

    - ``protocol``: the frame generation, ``"v1"`` (default: what today's LMCache ``lm://``
      connector speaks, and the only one that carries tensor metadata) or ``"v0"`` (LMCache
      <= 0.3 servers). lmserver accepts both on one port.
    - ``timeout``: seconds, or a `Timeout` for connect/read/write/pool separately and for
      ``total``, the deadline of one call: its waits, retries and backoff all end within it.
    - ``retry``: retries after a network error, or a `Retry` policy (backoff, timeouts).
    - ``max_connections``: connections per server; each key's commands use one of them.
    - ``exist_many``: ``"auto"`` tries the EXIST_MANY extension once (bounded by
      ``probe_timeout``) and falls back to pipelined EXISTs if the server lacks it;
      ``"always"`` or ``"never"`` skip the probe.

    - ``servers``: several servers instead of ``host``/``port`` (``["h1:p1", ("h2", p2)]``;
      ``from_url("lm://h1:p1,h2:p2")``): each key lives on one, chosen by rendezvous
      hashing. A server that fails is skipped for a backoff period: its keys miss, plain
      PUTs to it are dropped (see `counters`), PUT_ACK raises `ServerDown`.
    - ``skip_down``: whether a failed server is skipped like that (default: with several
      servers only; with one, calls raise the error after their retries).

    Every command on a key goes to that key's connection (a stable hash of the key picks
    one of ``max_connections`` per server), so the server serves a key's commands in the
    caller's order: a ``get`` after a plain ``put`` sees it, from any thread.
    """

    def _init_io(self) -> None:
        self._pools = [_Pool(self._settings, address) for address in self._settings.servers]

    def close(self) -> None:
        """Close every connection; the client cannot be used afterwards."""
        self._closed = True
        for pool in self._pools:
            pool.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- I/O --------------------------------------------------------------------------

    def _drive(self, flow: Flow[T], total: float | None = None) -> T:
        return run_blocking(self._call(flow, total))

    async def _sleep(self, seconds: float) -> None:
        time.sleep(seconds)  # noqa: ASYNC251 - blocking by design, see run_blocking

    async def _exchange(self, batch: Batch) -> list[Received | None]:  # blocking
        self._check_open()
        pool = self._pools[batch.server]
        lane, conn = pool.acquire(batch.lane, batch.deadline)
        try:
            received = conn.exchange(batch)
        except BaseException:
            pool.discard(lane, conn)
            raise
        pool.release(lane, conn)
        return received

    def _open_lanes(self, server: int) -> list[int]:
        return self._pools[server].open_lanes()

    # -- commands ---------------------------------------------------------------------

    def put(self, key: str, data: Any, *, meta: ObjectMeta | None = None, ack: bool = False) -> None:
        """Store ``data`` (any bytes-like object, numpy array or CPU tensor) under ``key``.

        Without ``ack`` this is upstream's fire-and-forget PUT: nothing comes back, so a
        refusal (no space, too large) goes unnoticed. ``ack=True`` sends PUT_ACK (an
        lmserver extension) and raises `ServerError` unless the object was stored.
        ``meta`` (v1 only) is stored with the object and returned by `get_with_meta`.
        """
        self._drive(self._single(self._commands.put(key, data, meta, ack)))

    def get(self, key: str) -> bytes | None:
        """The object under ``key``, or None on a miss. (`get_into` avoids the copy.)"""
        return self._drive(self._single(self._commands.get(key)))

    def get_with_meta(self, key: str) -> tuple[bytes, ObjectMeta] | None:
        """The object and its v1 metadata (`lmproto.NO_META` over v0), or None on a miss."""
        return self._drive(self._single(self._commands.get_with_meta(key)))

    def get_into(self, key: str, buffer: Any) -> int | None:
        """Receive the object straight into ``buffer``; returns its length, None on a miss.

        ``buffer`` is any writable contiguous buffer: bytearray, memoryview, numpy array,
        CPU torch tensor. An object larger than it raises `BufferTooSmall` (the buffer is
        left untouched and the connection stays usable).
        """
        return self._drive(self._single(self._commands.get_into(key, buffer)))

    def exists(self, key: str) -> bool:
        return self._drive(self._single(self._commands.exists(key)))

    @overload
    def put_many(
        self,
        keys: Sequence[str],
        data: Sequence[Any],
        *,
        ack: bool = ...,
        return_exceptions: Literal[False] = ...,
    ) -> None: ...
    @overload
    def put_many(
        self, keys: Sequence[str], data: Sequence[Any], *, ack: bool = ..., return_exceptions: Literal[True]
    ) -> list[LMClientError | None]: ...
    def put_many(
        self, keys: Sequence[str], data: Sequence[Any], *, ack: bool = False, return_exceptions: bool = False
    ) -> list[LMClientError | None] | None:
        """`put` of each ``(key, data)`` pair, pipelined per connection and server.

        ``return_exceptions=True``: nothing is raised for a pair that fails; the result is
        one entry per pair, None where it was sent (stored, with ``ack``) and the error
        where not (a refusal with ``ack``, a server that is down, a connection that failed).
        Otherwise the first error is raised (the other pairs may or may not be stored)."""
        results = self._drive(self._put_many_flow(keys, data, ack, return_exceptions))
        return results if return_exceptions else None

    @overload
    def get_many(
        self, keys: Sequence[str], *, return_exceptions: Literal[False] = ...
    ) -> list[bytes | None]: ...
    @overload
    def get_many(
        self, keys: Sequence[str], *, return_exceptions: Literal[True]
    ) -> list[bytes | LMClientError | None]: ...
    def get_many(
        self, keys: Sequence[str], *, return_exceptions: bool = False
    ) -> list[bytes | None] | list[bytes | LMClientError | None]:
        """`get` of each key, pipelined per connection and server; results in order
        (``return_exceptions``: a key's error is its result, as in `put_many`)."""
        return self._drive(self._get_many_flow(keys, return_exceptions))

    @overload
    def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: Literal[False] = ...
    ) -> list[int | None]: ...
    @overload
    def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: Literal[True]
    ) -> list[int | LMClientError | None]: ...
    def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: bool = False
    ) -> list[int | None] | list[int | LMClientError | None]:
        """`get_into` of each key into its buffer, pipelined; lengths (None: miss) in order
        (``return_exceptions``: a key's error, e.g. `BufferTooSmall`, is its result)."""
        return self._drive(self._get_many_into_flow(keys, buffers, return_exceptions))

    @overload
    def delete_many(self, keys: Iterable[str], *, return_exceptions: Literal[False] = ...) -> list[bool]: ...
    @overload
    def delete_many(
        self, keys: Iterable[str], *, return_exceptions: Literal[True]
    ) -> list[bool | LMClientError]: ...
    def delete_many(
        self, keys: Iterable[str], *, return_exceptions: bool = False
    ) -> list[bool] | list[bool | LMClientError]:
        """`delete` of each key (False: it was not there): one DELETE_MANY per connection
        and server, pipelined DELETEs where a server lacks it (``return_exceptions`` as in
        `put_many`)."""
        return self._drive(self._delete_many_flow(keys, return_exceptions))

    def list_page(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> Page:
        """One page of the keys starting with ``prefix``, in key order: up to ``limit``
        ``(key, size)`` pairs after the key ``after`` (size None where the server cannot
        tell it without I/O), and the ``after`` of the next page (None after the last).
        LIST_PAGE, an lmserver extension; a server may send fewer than ``limit``."""
        return self._drive(self._list_page_flow(prefix, after, limit))

    def exists_many(self, keys: Iterable[str]) -> list[bool]:
        """Presence of each key, in order: one EXIST_MANY round trip where the server has
        it, else EXISTs pipelined on one connection. See ``lmproto.hit_prefix``."""
        return self._drive(self._exists_many_flow(keys))

    def delete(self, key: str) -> bool:
        """Remove ``key``; False if it was not there (lmserver extension)."""
        return self._drive(self._single(self._commands.delete(key)))

    def health(self) -> bool:
        """True if the server answers HEALTH with success within ``probe_timeout``; False
        if it answers otherwise (e.g. while draining), too late, or cannot be reached."""
        return self._drive(self._health_flow(), self._settings.probe_timeout)

    def stats(self) -> dict[str, Any]:
        """The server's counters as a dict (lmserver extension)."""
        return self._drive(self._stats_flow())

    def put_tensor(
        self, key: str, tensor: torch.Tensor, *, fmt: int = MemoryFormat.UNDEFINED, ack: bool = False
    ) -> None:
        """Store a CPU contiguous tensor with its dtype and shape (<= 4 dims) as v1 metadata."""
        self._drive(self._single(self._put_tensor_op(key, tensor, fmt, ack)))

    def get_tensor(self, key: str) -> torch.Tensor | None:
        """A new tensor of the stored dtype and shape, received in place; None on a miss."""
        return self._drive(self._single(self._get_tensor_op(key, None)))

    def get_tensor_into(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Receive into ``tensor``, which must have the stored dtype and shape (else
        `TensorMismatch`, with ``tensor`` untouched). Returns ``tensor``; None on a miss."""
        return self._drive(self._single(self._get_tensor_op(key, tensor)))

    def list(self, prefix: str = "") -> list[str]:
        """Keys starting with ``prefix`` (the server may cap how many it sends)."""
        return self._drive(self._list_flow(prefix))
