"""`AsyncClient`: the asyncio client. Only socket I/O lives here; see _ops for the logic.

Strategy: non-blocking sockets driven with ``loop.add_reader``/``add_writer`` callbacks,
so this works on any event loop (uvloop included). Each connection is pipelined: any
number of coroutines queue their requests (buffers, never copied) in an outbox that one
callback flushes per loop iteration with ``sendmsg``, so a burst of small requests leaves
in one system call; one reader task reads the replies in FIFO order into each waiter's
sinks. A plain PUT queues no waiter, since it gets no reply; it returns once the kernel
has its bytes. Any error or timeout mid-exchange closes the connection and fails every
waiter on it with the same kind of error, so each is retried (or not) by the policy on a
fresh connection. Per server, ``max_connections`` lanes share the load: every command on a
key goes to its key's lane (see _placement), so a key's commands keep the caller's order;
a lane's connection is opened when it is first needed.
"""

from __future__ import annotations

import asyncio
import math
import socket
import time
from collections import deque
from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal, Self, TypeVar, overload

from lmproto import MAX_CONTROL_BODY, MemoryFormat, ObjectMeta

from ._config import Settings, wait_limit
from ._exceptions import (
    CONNECT_ERRORS,
    READ_ERRORS,
    ConnectTimeout,
    LMClientError,
    ReadError,
    ReadTimeout,
    TransportError,
    WriteError,
    WriteTimeout,
    map_exceptions,
)
from ._ops import BaseClient, Batch, Op, Page, settle
from ._placement import Address
from ._sync import Client
from ._tls import TLSSocket, wrap_nonblocking
from ._wire import IOV_MAX, Inbox, Received, advance, read_reply, readable_now, tune

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
Results = list[Received | None]


class _Waiter:
    """A batch whose requests are queued or sent and whose replies are awaited."""

    __slots__ = ("batch", "future", "sent")

    def __init__(self, batch: Batch, sent: asyncio.Event) -> None:
        self.batch = batch
        self.sent = sent  # set once the kernel has all of the batch's bytes
        self.future: asyncio.Future[Results] = asyncio.get_running_loop().create_future()


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _like(exc: TransportError) -> TransportError:
    """A fresh error of the same kind for another waiter (each gets its own traceback)."""
    copy = type(exc)(str(exc))
    copy.__cause__ = exc
    return copy


class _Connection:
    """One non-blocking socket with pipelined requests; lives on one event loop."""

    def __init__(self, sock: socket.socket | TLSSocket, settings: Settings) -> None:
        self._sock = sock
        self._fd = sock.fileno()
        self._settings = settings
        self._loop = asyncio.get_running_loop()
        self._inbox = Inbox()
        self._pending: deque[_Waiter] = deque()
        self._reader: asyncio.Task[None] | None = None
        self._error: TransportError | None = None
        self.load = 0  # exchanges in progress
        self._writes = 0  # batches queued so far (tests check which connection a key used)
        # Outgoing bytes: queued by many coroutines, sent together by _flush.
        self._outbox: list[memoryview] = []
        self._queued = 0  # bytes ever queued
        self._sent = 0  # bytes ever handed to the kernel
        # (end offset, its event, the deadline of the call that queued it)
        self._marks: deque[tuple[int, asyncio.Event, float]] = deque()
        self._flush_pending = False  # a _flush is scheduled or waits for writability
        self._stall: asyncio.TimerHandle | None = None

    @classmethod
    async def open(cls, settings: Settings, address: Address, limit: float) -> _Connection:
        """Connect (and shake hands, for TLS) within ``limit`` seconds."""
        loop = asyncio.get_running_loop()
        with map_exceptions(CONNECT_ERRORS):
            async with asyncio.timeout(limit):
                infos = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
                sock = await cls._connect_any(loop, infos)
                tune(sock, settings.timeout.connect)
                if settings.ssl_context is None:
                    return cls(sock, settings)
                return cls(await wrap_nonblocking(sock, settings.ssl_context, address.host), settings)

    @staticmethod
    async def _connect_any(loop: asyncio.AbstractEventLoop, infos: list[Any]) -> socket.socket:
        error: OSError = OSError("no address to connect to")
        for family, kind, proto, _, address in infos:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                await loop.sock_connect(sock, address)
                return sock
            except OSError as exc:
                sock.close()
                error = exc
            except BaseException:
                sock.close()
                raise
        raise error

    @property
    def usable(self) -> bool:
        return self._error is None

    def dropped(self) -> bool:
        """Whether this idle connection has bytes nobody asked for, or an EOF: unusable."""
        idle = self.load == 0 and not self._pending and not self._outbox
        return idle and (self._inbox.available > 0 or readable_now(self._sock))

    def close(self, error: TransportError) -> None:
        """Close now and fail every waiter; idempotent."""
        if self._error is not None:
            return
        self._error = error
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        if self._stall is not None:
            self._stall.cancel()
        self._outbox = []
        for _, sent, _ in self._marks:
            sent.set()  # wakes a PUT waiting for its bytes to go out: it sees the error
        self._marks.clear()
        if self._reader is not None and self._reader is not asyncio.current_task():
            self._reader.cancel()
        pending, self._pending = self._pending, deque()
        for waiter in pending:
            if not waiter.future.done():
                waiter.future.set_exception(_like(error))

    async def wait_closed(self) -> None:
        if self._reader is not None:
            await asyncio.wait([self._reader])

    async def exchange(self, batch: Batch) -> Results:
        self.load += 1
        try:
            return await self._exchange(batch)
        finally:
            self.load -= 1

    async def _exchange(self, batch: Batch) -> Results:
        if self._error is not None:
            raise _like(self._error)
        self._writes += 1
        end, sent = self._queue([buf for op in batch.ops for buf in op.buffers], batch.deadline)
        if not any(op.expects_reply for op in batch.ops):
            await sent.wait()  # the caller may reuse its buffers once the kernel has them
            if self._sent < end:
                assert self._error is not None
                raise _like(self._error)
            return [None] * len(batch.ops)
        waiter = _Waiter(batch, sent)
        self._pending.append(waiter)
        if self._reader is None:
            self._reader = self._loop.create_task(self._read_replies())
        return await waiter.future

    # -- writing: requests queued in this loop iteration leave in one sendmsg -----------

    def _queue(self, buffers: list[memoryview], deadline: float) -> tuple[int, asyncio.Event]:
        self._outbox += buffers
        self._queued += sum(len(buf) for buf in buffers)
        sent = asyncio.Event()
        self._marks.append((self._queued, sent, deadline))
        if not self._flush_pending:
            self._flush_pending = True
            self._loop.call_soon(self._flush)
        return self._queued, sent

    def _flush(self) -> None:
        """Send what the kernel takes; then wait for writability, at most the write timeout
        without progress, and no later than the deadline of the oldest call still sending."""
        if self._error is not None:
            return
        before = self._sent
        try:
            while self._outbox:
                count = self._sock.sendmsg(self._outbox[:IOV_MAX])
                self._outbox = advance(self._outbox, count)
                self._sent += count
        except (BlockingIOError, InterruptedError):
            pass
        except OSError as exc:
            self.close(WriteError(str(exc) or type(exc).__name__))
            return
        while self._marks and self._marks[0][0] <= self._sent:
            self._marks.popleft()[1].set()
        if self._stall is not None and (self._sent > before or not self._outbox):
            self._stall.cancel()  # progress: the write timeout starts over
            self._stall = None
        if not self._outbox:
            self._loop.remove_writer(self._fd)
            self._flush_pending = False
        else:
            self._loop.add_writer(self._fd, self._flush)
            if self._stall is None:
                deadline = self._marks[0][2] if self._marks else math.inf
                limit = max(0.0, min(self._settings.timeout.write, deadline - time.monotonic()))
                self._stall = self._loop.call_later(limit, self._stalled, limit)

    def _stalled(self, limit: float) -> None:
        self._stall = None
        self.close(WriteTimeout(f"the server took no bytes for {limit:.3g}s"))

    # -- reading: one task reads replies in order into each waiter's sinks --------------

    async def _read_replies(self) -> None:
        """The reader task: runs while waiters are queued, answering them in order."""
        try:
            while self._pending:
                waiter = self._pending[0]
                await waiter.sent.wait()  # never time a reply while its request is still going out
                batch = waiter.batch
                limit = batch.read_timeout or self._settings.timeout.read
                results = [
                    await self._read(op, limit, batch.deadline) if op.expects_reply else None
                    for op in batch.ops
                ]
                self._pending.popleft()
                if not waiter.future.done():  # its coroutine may have been cancelled
                    waiter.future.set_result(results)
        except TransportError as exc:
            self.close(exc)
        except Exception as exc:  # a failing sink: its own waiter gets the error itself
            if self._pending and not self._pending[0].future.done():
                self._pending.popleft().future.set_exception(exc)
            self.close(ReadError(f"connection closed after {type(exc).__name__} in a reply"))
        finally:
            self._reader = None

    async def _read(self, op: Op[Any], limit: float, deadline: float) -> Received:
        flow = read_reply(self._inbox, self._settings.generation, op.sink, MAX_CONTROL_BODY)
        with map_exceptions(READ_ERRORS):
            try:
                view = next(flow)
                while True:
                    view = flow.send(await self._recv_into(view, limit, deadline))
            except StopIteration as stop:
                received: Received = stop.value
                return received

    async def _recv_into(self, view: memoryview, limit: float, deadline: float) -> int:
        while True:
            try:
                return self._sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._readable(wait_limit(deadline, limit, ReadTimeout))

    async def _readable(self, limit: float) -> None:
        ready: asyncio.Future[None] = self._loop.create_future()
        self._loop.add_reader(self._fd, _wake, ready)
        try:
            async with asyncio.timeout(limit):
                await ready
        except TimeoutError:
            raise ReadTimeout(f"no reply byte for {limit:.3g}s") from None
        finally:
            if self._error is None:  # else close() unregistered it before closing the socket
                self._loop.remove_reader(self._fd)


class AsyncClient(BaseClient):
    """asyncio lm:// client: the twin of `Client`, with the same arguments and methods
    (``await``-ed; ``aclose`` for ``close``). Safe for many concurrent coroutines on one
    event loop: their requests are pipelined on up to ``max_connections`` connections.
    Not thread-safe, and bound to the event loop it first ran on.

    Every command on a key goes to its key's connection (lane), so a ``get`` after a
    plain ``put`` of the same key sees it, whatever other coroutines do; see `Client`
    for ``servers`` (several servers, rendezvous hashing, down servers skipped).

    Cancelling a call abandons its answer, not its request: a request already sent still
    has its reply read (keeping the connection in step), so a cancelled ``get_into`` may
    fill its buffer afterwards. Do not reuse that buffer for something else right away.
    """

    def _init_io(self) -> None:
        lanes = self._settings.max_connections
        self._lanes: list[list[_Connection | None]] = [[None] * lanes for _ in self._settings.servers]
        self._connect_locks = [asyncio.Lock() for _ in self._settings.servers]

    async def aclose(self) -> None:
        """Close every connection; the client cannot be used afterwards."""
        self._closed = True
        conns = [conn for lanes in self._lanes for conn in lanes if conn is not None]
        self._lanes = [[None] * len(lanes) for lanes in self._lanes]
        for conn in conns:
            conn.close(ReadError("the client was closed"))
        for conn in conns:
            await conn.wait_closed()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # -- I/O --------------------------------------------------------------------------

    async def _sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)

    async def _run_all(self, batches: list[Batch]) -> list[list[Any]]:
        """Each batch's results, the batches running concurrently (each on its own lane,
        or pipelined on a shared one); the first error once all have finished."""
        if len(batches) == 1:  # no task to create
            try:
                return [await self._run(batches[0])]
            except LMClientError as exc:
                return settle(batches, [exc])
        outcomes = await asyncio.gather(*(self._run(batch) for batch in batches), return_exceptions=True)
        return settle(batches, outcomes)

    async def _exchange(self, batch: Batch) -> Results:
        self._check_open()
        lanes = self._lanes[batch.server]
        lane = self._pick(lanes) if batch.lane is None else batch.lane
        conn = lanes[lane]
        if conn is None or not conn.usable or conn.dropped():
            if conn is not None and conn.usable:
                conn.close(ReadError("the server closed the connection"))
            conn = await self._connect(batch, lane)
        return await conn.exchange(batch)

    async def _connect(self, batch: Batch, lane: int) -> _Connection:
        """The lane's connection, opened now unless another coroutine just did; waiting for
        the server's connect lock counts against the connect timeout and the deadline."""
        limit = wait_limit(batch.deadline, self._settings.timeout.connect, ConnectTimeout)
        lanes = self._lanes[batch.server]
        try:
            async with asyncio.timeout(limit):
                async with self._connect_locks[batch.server]:
                    self._check_open()
                    conn = lanes[lane]
                    if conn is None or not conn.usable:
                        address = self._settings.servers[batch.server]
                        conn = await _Connection.open(self._settings, address, limit)
                        lanes[lane] = conn
                    return conn
        except TimeoutError:  # the lock was not ours in time
            raise ConnectTimeout(f"no connection within {limit:.3g}s") from None

    @staticmethod
    def _pick(lanes: list[_Connection | None]) -> int:
        """For a command on no key: an idle open lane, else an unopened one, else the
        least busy."""
        live = [(conn.load, i) for i, conn in enumerate(lanes) if conn is not None and conn.usable]
        if live and min(live)[0] == 0:
            return min(live)[1]
        unopened = [i for i, conn in enumerate(lanes) if conn is None or not conn.usable]
        if unopened:
            return unopened[0]
        return min(live)[1]

    def _open_lanes(self, server: int) -> list[int]:
        return [i for i, conn in enumerate(self._lanes[server]) if conn is not None and conn.usable]

    # -- commands: documented on Client ----------------------------------------------

    async def put(self, key: str, data: Any, *, meta: ObjectMeta | None = None, ack: bool = False) -> None:
        await self._call(self._single(self._commands.put(key, data, meta, ack)))

    async def get(self, key: str) -> bytes | None:
        return await self._call(self._single(self._commands.get(key)))

    async def get_with_meta(self, key: str) -> tuple[bytes, ObjectMeta] | None:
        return await self._call(self._single(self._commands.get_with_meta(key)))

    async def get_into(self, key: str, buffer: Any) -> int | None:
        return await self._call(self._single(self._commands.get_into(key, buffer)))

    async def exists(self, key: str) -> bool:
        return await self._call(self._single(self._commands.exists(key)))

    @overload
    async def put_many(
        self,
        keys: Sequence[str],
        data: Sequence[Any],
        *,
        ack: bool = ...,
        return_exceptions: Literal[False] = ...,
    ) -> None: ...
    @overload
    async def put_many(
        self, keys: Sequence[str], data: Sequence[Any], *, ack: bool = ..., return_exceptions: Literal[True]
    ) -> list[LMClientError | None]: ...
    async def put_many(
        self, keys: Sequence[str], data: Sequence[Any], *, ack: bool = False, return_exceptions: bool = False
    ) -> list[LMClientError | None] | None:
        results = await self._call(self._put_many_flow(keys, data, ack, return_exceptions))
        return results if return_exceptions else None

    @overload
    async def get_many(
        self, keys: Sequence[str], *, return_exceptions: Literal[False] = ...
    ) -> list[bytes | None]: ...
    @overload
    async def get_many(
        self, keys: Sequence[str], *, return_exceptions: Literal[True]
    ) -> list[bytes | LMClientError | None]: ...
    async def get_many(
        self, keys: Sequence[str], *, return_exceptions: bool = False
    ) -> list[bytes | None] | list[bytes | LMClientError | None]:
        return await self._call(self._get_many_flow(keys, return_exceptions))

    @overload
    async def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: Literal[False] = ...
    ) -> list[int | None]: ...
    @overload
    async def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: Literal[True]
    ) -> list[int | LMClientError | None]: ...
    async def get_many_into(
        self, keys: Sequence[str], buffers: Sequence[Any], *, return_exceptions: bool = False
    ) -> list[int | None] | list[int | LMClientError | None]:
        return await self._call(self._get_many_into_flow(keys, buffers, return_exceptions))

    @overload
    async def delete_many(
        self, keys: Iterable[str], *, return_exceptions: Literal[False] = ...
    ) -> list[bool]: ...
    @overload
    async def delete_many(
        self, keys: Iterable[str], *, return_exceptions: Literal[True]
    ) -> list[bool | LMClientError]: ...
    async def delete_many(
        self, keys: Iterable[str], *, return_exceptions: bool = False
    ) -> list[bool] | list[bool | LMClientError]:
        return await self._call(self._delete_many_flow(keys, return_exceptions))

    async def list_page(self, prefix: str = "", *, after: str = "", limit: int = 1000) -> Page:
        return await self._call(self._list_page_flow(prefix, after, limit))

    async def exists_many(self, keys: Iterable[str]) -> list[bool]:
        return await self._call(self._exists_many_flow(keys))

    async def delete(self, key: str) -> bool:
        return await self._call(self._single(self._commands.delete(key)))

    async def health(self) -> bool:
        return await self._call(self._health_flow(), self._settings.probe_timeout)

    async def stats(self) -> dict[str, Any]:
        return await self._call(self._stats_flow())

    async def put_tensor(
        self, key: str, tensor: torch.Tensor, *, fmt: int = MemoryFormat.UNDEFINED, ack: bool = False
    ) -> None:
        await self._call(self._single(self._put_tensor_op(key, tensor, fmt, ack)))

    async def get_tensor(self, key: str) -> torch.Tensor | None:
        return await self._call(self._single(self._get_tensor_op(key, None)))

    async def get_tensor_into(self, key: str, tensor: torch.Tensor) -> torch.Tensor | None:
        return await self._call(self._single(self._get_tensor_op(key, tensor)))

    async def list(self, prefix: str = "") -> list[str]:
        return await self._call(self._list_flow(prefix))


for _name, _method in vars(AsyncClient).items():
    if not _name.startswith("_") and _method.__doc__ is None:
        _method.__doc__ = getattr(Client, _name).__doc__
