"""The command logic both clients share: requests to send, replies to interpret, flows.

Strategy: an `Op` is one request (its header and body buffers) plus how to receive and
interpret its reply; a `Batch` is ops sent back to back on one connection (pipelined) and
retried together. Which connection is decided here, once for both clients (_placement): a
key's server by rendezvous hashing, and within it the key's *lane*, so every command on a
key travels on one socket and the server serves them in the caller's order. A *flow* is a
generator that yields batches (or a list of batches for different connections, run
concurrently) and gets their results back (or has the error thrown in), which lets a
command need several round trips (EXIST_MANY with its fallback) or span servers.
`BaseClient` runs flows, with retries and skipping of servers that are down, in one
coroutine over a few I/O primitives that `Client` and `AsyncClient` implement: that is all
they add.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from lmproto import (
    NO_META,
    UNKNOWN_SIZE,
    Command,
    Generation,
    LocalProtocolError,
    MalformedBody,
    ObjectMeta,
    Reply,
    Status,
    decode_error_text,
    decode_json,
    decode_key_lines,
    decode_page,
    decode_presence,
    encode_key_list,
    encode_page_request,
    encode_request,
)

from ._config import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    ExistManyMode,
    ProtocolName,
    Retry,
    ServerSpec,
    Settings,
    Timeout,
    compute_backoff,
    make_settings,
    parse_servers,
    url_wants_tls,
)
from ._exceptions import (
    BufferTooSmall,
    ConnectError,
    ConnectTimeout,
    InvalidRequest,
    LMClientError,
    PoolTimeout,
    ProtocolError,
    ReadError,
    ReadTimeout,
    ServerDown,
    ServerError,
    TimeoutException,
    TransportError,
    WriteError,
)
from ._placement import Address, Placement
from ._tls import SslOption
from ._wire import Received, Sink, fresh_sink, readable_view, writable_view

if TYPE_CHECKING:
    import torch

    from ._tensor import TensorSink

T = TypeVar("T")
log = logging.getLogger("lmclient")

EXIST_WINDOW = 256
"""Pipelined EXISTs per batch in the EXIST_MANY fallback (bounds what the sync client
sends before it reads replies)."""
HEALTH_KEY = "lmclient@1@0@0@bfloat16"
"""Sent with HEALTH, which ignores its key: upstream's v1 server drops a connection whose
key does not parse as a CacheEngineKey, an empty one included."""
EXIST_MANY_KEYS = 16384
"""Keys per EXIST_MANY request: at 151 bytes a key, under lmproto.MAX_CONTROL_BODY."""


@dataclass(slots=True, eq=False)
class Op(Generic[T]):
    """One request; ``interpret`` is None for a plain PUT, which gets no reply.

    ``key`` places it (see _placement); ``fallback`` is its result when its server is down
    and the client has several servers (a miss, a dropped PUT), None where the caller must
    hear of the failure (PUT_ACK).
    """

    buffers: list[memoryview]
    interpret: Callable[[Received], T] | None
    sink: Sink = fresh_sink
    key: str = ""
    fallback: Callable[[], T] | None = None

    @property
    def expects_reply(self) -> bool:
        return self.interpret is not None


@dataclass(slots=True, eq=False)
class Batch:
    """Ops sent back to back on one connection; ``read_timeout`` overrides the client's.

    ``server`` and ``lane`` say which connection: every op on a key travels in its key's
    lane, so the server sees a key's commands in the order the caller issued them.
    ``lane=None`` (commands on no key) takes whichever connection is free.
    """

    ops: Sequence[Op[Any]]
    read_timeout: float | None = None
    probe: bool = False
    """The server may lack the command: only failures to connect are retried."""
    server: int = 0
    lane: int | None = None
    settle: bool = False
    """Each op's error is its result (``return_exceptions``): an op that fails, or every
    op of a batch that fails whole, reports its error instead of raising it."""
    deadline: float = math.inf
    """``time.monotonic()`` by which the call that sends it must end (set by `_call`): every
    wait of the exchange is cut to it, and no retry starts that would end past it."""


RawPage = tuple[list[tuple[str, int]], bool]
"""A LIST_PAGE reply: (key, size) pairs, and whether more keys follow."""
Page = tuple[list[tuple[str, int | None]], str | None]
"""A LIST_PAGE answer: (key, size or None if the server cannot tell) pairs in key order, and
the cursor to pass as ``after`` for the next page (None after the last)."""

Step = Batch | list[Batch]
"""What a flow yields: one batch (sent back its results), or batches for different
connections that run concurrently (sent back each one's results, in order)."""
Flow = Generator[Step, Any, T]


def interpret(batch: Batch, received: Sequence[Received | None]) -> list[Any]:
    """Each op's result from its reply (None for a PUT); raises the first op's error, or
    in a settling batch returns each op's error as its result."""
    if batch.settle:
        return [_settled(op, rcv) for op, rcv in zip(batch.ops, received, strict=True)]
    return [
        None if op.interpret is None or rcv is None else op.interpret(rcv)
        for op, rcv in zip(batch.ops, received, strict=True)
    ]


def _settled(op: Op[Any], received: Received | None) -> Any:
    try:
        return None if op.interpret is None or received is None else op.interpret(received)
    except LMClientError as exc:
        return exc


def settle(batches: Sequence[Batch], outcomes: Sequence[list[Any] | BaseException]) -> list[list[Any]]:
    """Each batch's results from its outcome (its results, or the error it failed with):
    a settling batch's error becomes each of its ops' result; otherwise the first error
    is raised once all have run."""
    results: list[list[Any]] = []
    error: BaseException | None = None
    for batch, outcome in zip(batches, outcomes, strict=True):
        if not isinstance(outcome, BaseException):
            results.append(outcome)
        elif batch.settle and isinstance(outcome, LMClientError):
            results.append([outcome] * len(batch.ops))
        else:
            error = error or outcome
            results.append([])
    if error is not None:
        raise error
    return results


# ---------------------------------------------------------------------------------------
# reply interpretation


def _failure(command: str, received: Received) -> ServerError:
    body = received.body
    return ServerError(received.reply.status, decode_error_text(body) if body else "", command=command)


def _check_ok(command: str) -> Callable[[Received], None]:
    def interpret(received: Received) -> None:
        if received.reply.status != Status.SUCCESS:
            raise _failure(command, received)

    return interpret


def _yes_no(command: str, no: int) -> Callable[[Received], bool]:
    """SUCCESS is True, ``no`` is False, anything else a ServerError."""

    def interpret(received: Received) -> bool:
        status = received.reply.status
        if status == Status.SUCCESS or status == no:
            return status == Status.SUCCESS
        raise _failure(command, received)

    return interpret


def _hit(received: Received) -> memoryview | None:
    """A GET reply's body: None on a miss (400), raises on other errors or a refusal."""
    status = received.reply.status
    if status == Status.FAIL:
        return None
    if status != Status.SUCCESS:
        raise _failure("GET", received)
    if received.refusal is not None:
        raise received.refusal
    assert received.body is not None
    return received.body


def _decoded(command: str, decode: Callable[[memoryview], T]) -> Callable[[Received], T]:
    def interpret(received: Received) -> T:
        if received.reply.status != Status.SUCCESS or received.body is None:
            raise _failure(command, received)
        try:
            return decode(received.body)
        except MalformedBody as exc:
            raise ProtocolError(f"{command} reply: {exc}") from exc

    return interpret


def _with_meta(received: Received) -> tuple[bytes, ObjectMeta] | None:
    body = _hit(received)
    return None if body is None else (bytes(body), received.reply.meta)


def _body_bytes(received: Received) -> bytes | None:
    body = _hit(received)
    return None if body is None else bytes(body)


def _body_length(received: Received) -> int | None:
    body = _hit(received)
    return None if body is None else len(body)


def _health(received: Received) -> bool:
    return received.reply.status == Status.SUCCESS


# ---------------------------------------------------------------------------------------
# request building


class Commands:
    """Builds the `Op` for each command in one frame generation."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation

    def _op(
        self,
        command: Command,
        interpret: Callable[[Received], T] | None,
        key: str = "",
        body: memoryview | None = None,
        meta: ObjectMeta = NO_META,
        sink: Sink = fresh_sink,
        fallback: Callable[[], T] | None = None,
    ) -> Op[T]:
        length = len(body) if body is not None else 0
        try:
            header = encode_request(command, key, length, generation=self.generation, meta=meta)
        except LocalProtocolError as exc:
            raise InvalidRequest(str(exc)) from exc
        buffers = [memoryview(header)]
        if length:
            assert body is not None
            buffers.append(body)
        return Op(buffers, interpret, sink, key, fallback)

    def _keyed(self, key: str) -> str:
        if not key:
            raise InvalidRequest("key must not be empty")
        return key

    def put(self, key: str, data: Any, meta: ObjectMeta | None, ack: bool) -> Op[None]:
        if meta is not None and self.generation == Generation.V0:
            raise InvalidRequest("v0 frames carry no metadata; use protocol='v1'")
        command = Command.PUT_ACK if ack else Command.PUT
        interpret = _check_ok("PUT_ACK") if ack else None
        # A plain PUT to a server that is down is dropped (and counted): fire-and-forget.
        fallback = None if ack else _none
        body = readable_view(data)
        return self._op(command, interpret, self._keyed(key), body, meta or NO_META, fallback=fallback)

    def get(self, key: str) -> Op[bytes | None]:
        return self._op(Command.GET, _body_bytes, self._keyed(key), fallback=_none)

    def get_with_meta(self, key: str) -> Op[tuple[bytes, ObjectMeta] | None]:
        return self._op(Command.GET, _with_meta, self._keyed(key), fallback=_none)

    def get_with(self, key: str, sink: Sink, result: Callable[[Received], T | None]) -> Op[T | None]:
        """A GET whose hit lands where ``sink`` says (chosen from the reply's metadata, as
        the LMCache plugin does), returning ``result(received)``; None on a miss, and when
        the sink refused the object (it was drained; the sink knows why)."""

        def interpret(received: Received) -> T | None:
            if received.reply.status == Status.SUCCESS and received.refusal is not None:
                return None
            return None if _hit(received) is None else result(received)

        return self._op(Command.GET, interpret, self._keyed(key), sink=sink, fallback=_none)

    def get_into(self, key: str, buffer: Any) -> Op[int | None]:
        view = writable_view(buffer)

        def into(reply: Reply) -> memoryview | LMClientError:
            return view if reply.length <= len(view) else BufferTooSmall(reply.length, len(view))

        return self._op(Command.GET, _body_length, self._keyed(key), sink=into, fallback=_none)

    def get_tensor(self, key: str, sink: TensorSink) -> Op[torch.Tensor | None]:
        self._require_v1("tensor helpers")

        def interpret(received: Received) -> torch.Tensor | None:
            return None if _hit(received) is None else sink.tensor

        return self._op(Command.GET, interpret, self._keyed(key), sink=sink, fallback=_none)

    def exists(self, key: str) -> Op[bool]:
        return self._op(Command.EXIST, _yes_no("EXIST", Status.FAIL), self._keyed(key), fallback=_false)

    def exist_many(self, keys: Sequence[str]) -> list[Op[list[bool]]]:
        return self._key_lists(Command.EXIST_MANY, keys, _presence)

    def _key_lists(
        self, command: Command, keys: Sequence[str], interpret: Callable[[int], Callable[[Received], T]]
    ) -> list[Op[T]]:
        """Requests carrying ``keys`` as key lists (as many as they need), each interpreted
        by ``interpret(its number of keys)``; a server that is down: all absent."""
        ops: list[Op[T]] = []
        for start in range(0, len(keys), EXIST_MANY_KEYS):
            chunk = keys[start : start + EXIST_MANY_KEYS]
            try:
                body = memoryview(encode_key_list(chunk))
            except LocalProtocolError as exc:
                raise InvalidRequest(str(exc)) from exc
            misses: Callable[[], Any] = _misses(len(chunk))
            ops.append(self._op(command, interpret(len(chunk)), body=body, fallback=misses))
        return ops

    def delete(self, key: str) -> Op[bool]:
        deleted = _yes_no("DELETE", Status.NOT_FOUND)
        return self._op(Command.DELETE, deleted, self._keyed(key), fallback=_false)

    def delete_many(self, keys: Sequence[str]) -> list[Op[list[bool] | None]]:
        """DELETE_MANY requests (as many as the keys need): each op's result is one bool per
        key (deleted, or not there), or None when the server lacks the command."""
        return self._key_lists(Command.DELETE_MANY, keys, _deleted_many)

    def list(self, prefix: str) -> Op[list[str]]:
        # lmserver filters by the prefix sent as the key; filter again for servers that don't.
        def keys(body: memoryview) -> list[str]:
            return [k for k in decode_key_lines(body) if k.startswith(prefix)]

        return self._op(Command.LIST, _decoded("LIST", keys), prefix, fallback=list)

    def list_page(self, prefix: str, after: str, limit: int) -> Op[RawPage]:
        try:
            body = memoryview(encode_page_request(limit, after))
        except LocalProtocolError as exc:
            raise InvalidRequest(str(exc)) from exc
        return self._op(
            Command.LIST_PAGE, _decoded("LIST_PAGE", decode_page), prefix, body, fallback=_no_page
        )

    def health(self) -> Op[bool]:
        return self._op(Command.HEALTH, _health, HEALTH_KEY, fallback=_false)

    def fence(self) -> Op[bool]:
        """A cheap request whose reply shows that the server has taken in everything sent
        before it on the same connection (EXIST exists in both frame generations)."""
        return self._op(Command.EXIST, _yes_no("EXIST", Status.FAIL), HEALTH_KEY, fallback=_false)

    def stats(self) -> Op[dict[str, Any]]:
        return self._op(Command.STATS, _decoded("STATS", decode_json), fallback=dict)

    def _require_v1(self, what: str) -> None:
        if self.generation != Generation.V1:
            raise InvalidRequest(f"{what} need v1 metadata; this client speaks v0 (protocol='v0')")


def _none() -> None:
    return None


def _false() -> bool:
    return False


def _no_page() -> RawPage:
    return [], False


def _misses(count: int) -> Callable[[], list[bool]]:
    return lambda: [False] * count


def _presence_bytes(count: int) -> Callable[[memoryview], list[bool]]:
    """A decoder of one byte per key (EXIST_MANY's and DELETE_MANY's replies)."""

    def decode(body: memoryview) -> list[bool]:
        if len(body) != count:
            raise MalformedBody(f"{len(body)} presence bytes for {count} keys")
        return decode_presence(body)

    return decode


def _presence(count: int) -> Callable[[Received], list[bool]]:
    return _decoded("EXIST_MANY", _presence_bytes(count))


def _deleted_many(count: int) -> Callable[[Received], list[bool] | None]:
    presence = _decoded("DELETE_MANY", _presence_bytes(count))

    def interpret(received: Received) -> list[bool] | None:
        if received.reply.status == Status.FAIL and not received.body:
            return None  # an unknown command's answer: the server predates DELETE_MANY
        return presence(received)

    return interpret


def _means_unsupported(exc: LMClientError) -> bool:
    """Whether a failed EXIST_MANY probe says the server lacks the command.

    lmserver answers it; an upstream v1 server drops the connection on its empty key; an
    upstream v0 server never answers unknown commands (so the probe times out).
    """
    if isinstance(exc, ServerError):
        return exc.status == Status.FAIL
    return isinstance(exc, ReadError | WriteError | ReadTimeout | ProtocolError)


# ---------------------------------------------------------------------------------------
# the client base


class _ServerState:
    """Whether a server is believed down, and when to try it again (several servers only)."""

    __slots__ = ("address", "failures", "retry_at")

    def __init__(self, address: Address) -> None:
        self.address = address
        self.failures = 0  # consecutive failed exchanges
        self.retry_at = 0.0  # time.monotonic() before which its keys miss without I/O


DOWN_BACKOFF = Retry(retries=0, base=0.5, cap=30.0)
"""How long a server that failed is skipped: 0.25-0.5 s after the first failure, doubling
with each failed retry up to 15-30 s (jittered; see compute_backoff)."""


class BaseClient:
    """Configuration, validation, placement and flows of both clients; subclasses add only I/O."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        servers: Sequence[ServerSpec] | None = None,
        protocol: ProtocolName | Generation = "v1",
        timeout: float | Timeout = DEFAULT_TIMEOUT,
        retry: int | Retry = 3,
        max_connections: int = 4,
        exist_many: ExistManyMode = "auto",
        probe_timeout: float = 2.0,
        skip_down: bool | None = None,
        ssl: SslOption = None,
    ) -> None:
        self._settings: Settings = make_settings(
            servers if servers is not None else [(host, port)],
            protocol,
            timeout,
            retry,
            max_connections,
            exist_many,
            probe_timeout,
            ssl,
        )
        self._commands = Commands(self._settings.generation)
        self._placement = Placement(self._settings.servers, max_connections)
        self._servers = [_ServerState(address) for address in self._settings.servers]
        # With several servers, one that is down must not fail the caller: its keys miss.
        # With one, by default the caller hears of the failure (it has nowhere else to go).
        self._skip_down = len(self._servers) > 1 if skip_down is None else skip_down
        self._counts = {"unavailable": 0, "dropped_puts": 0, "server_down": 0}
        self._counts_lock = threading.Lock()
        self._exist_many: bool | None = {"auto": None, "always": True, "never": False}[exist_many]
        self._delete_many = True  # until a server answers DELETE_MANY as an unknown command
        self._closed = False
        self._init_io()

    def _init_io(self) -> None:
        raise NotImplementedError

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Self:
        """A client for ``lm://host:port`` (LMCache's ``LMCACHE_REMOTE_URL`` form), for
        several servers (``lm://h1:p1,h2:p2,...``), or ``lms://`` for TLS with the system's
        CAs (pass ``ssl=context`` for others)."""
        if url_wants_tls(url):
            kwargs.setdefault("ssl", True)
        return cls(servers=parse_servers(url), **kwargs)

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def counters(self) -> dict[str, int]:
        """Client-side counters: ``unavailable`` (operations answered as a miss because
        their server was down), ``dropped_puts`` (plain PUTs among them), ``server_down``
        (times a server was found down). Always zero with a single server."""
        with self._counts_lock:
            return dict(self._counts)

    def server_for(self, key: str) -> str:
        """``host:port`` of the server that holds ``key`` (rendezvous hashing)."""
        return str(self._settings.servers[self._placement.server(key)])

    def __repr__(self) -> str:
        s = self._settings
        state = "closed" if self._closed else "open"
        servers = ",".join(map(str, s.servers))
        return f"<{type(self).__name__} lm://{servers} {s.generation.name.lower()} {state}>"

    def _check_open(self) -> None:
        if self._closed:
            raise LMClientError(f"{type(self).__name__} is closed")

    # -- running flows: the one loop both clients use ---------------------------------
    #
    # Written once as coroutines over three I/O primitives: ``_exchange``, ``_sleep`` and
    # ``_open_lanes``. AsyncClient awaits them on its event loop; Client implements them
    # as blocking calls that never suspend, so it runs these coroutines to completion with
    # a single ``send(None)`` (see _sync.run_blocking), without an event loop.

    async def _exchange(self, batch: Batch) -> list[Received | None]:
        """Send ``batch`` on its connection and read its replies (None for a PUT)."""
        raise NotImplementedError

    async def _sleep(self, seconds: float) -> None:
        raise NotImplementedError

    def _open_lanes(self, server: int) -> list[int]:
        """The lanes of ``server`` that have a live connection (which may hold PUTs)."""
        raise NotImplementedError

    async def _call(self, flow: Flow[T], total: float | None = None) -> T:
        """Run ``flow``: each step it yields goes to `_run`/`_run_all`, results or error back.
        The whole call ends within ``total`` seconds (default: `Timeout` ``total``)."""
        deadline = time.monotonic() + (self._settings.timeout.total if total is None else total)
        try:
            step = next(flow)
            while True:
                for batch in [step] if isinstance(step, Batch) else step:
                    batch.deadline = deadline
                try:
                    results = await (self._run(step) if isinstance(step, Batch) else self._run_all(step))
                except LMClientError as exc:
                    step = flow.throw(exc)
                else:
                    step = flow.send(results)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _run_all(self, batches: list[Batch]) -> list[list[Any]]:
        """Each batch's results, in order; the first error once all have run (see
        `settle`). One after the other here (blocking I/O); AsyncClient runs them
        concurrently."""
        outcomes: list[list[Any] | BaseException] = []
        for batch in batches:
            try:
                outcomes.append(await self._run(batch))
            except LMClientError as exc:
                outcomes.append(exc)
        return settle(batches, outcomes)

    async def _run(self, batch: Batch) -> list[Any]:
        """One batch's results; a server that is down answers with the ops' fallbacks."""
        server = self._servers[batch.server]
        if time.monotonic() >= batch.deadline:
            # The call's earlier batches used up its time (one server after another, in the
            # blocking client): this server was never asked, so it is not marked down.
            late = TimeoutException(f"the call's deadline passed before lm://{server.address} was asked")
            if not self._skip_down:
                raise late
            return self._unavailable(batch, late)
        if self._skip_down and time.monotonic() < server.retry_at:
            return self._unavailable(batch, None)
        try:
            results = await self._attempts(batch)
        except TransportError as exc:
            # A probe's read failure means "no such command", not "server down".
            down = not batch.probe or isinstance(exc, ConnectError | ConnectTimeout)
            if not self._skip_down or isinstance(exc, PoolTimeout) or not down:
                raise
            self._mark_down(server, exc)
            return self._unavailable(batch, exc)
        if server.failures:
            log.info("lm://%s is back after %d failed attempts", server.address, server.failures)
            server.failures = 0
        return results

    async def _attempts(self, batch: Batch) -> list[Any]:
        """One batch's results, retried on fresh connections as the policy and the call's
        deadline allow."""
        for attempt in itertools.count():
            try:
                return interpret(batch, await self._exchange(batch))
            except TransportError as exc:
                retryable = not batch.probe or isinstance(exc, ConnectError | ConnectTimeout)
                delay = self._settings.retry.delay(exc, attempt) if retryable else None
                if delay is None or time.monotonic() + delay >= batch.deadline:
                    raise
                log.debug("retrying in %.3fs after %s: %s", delay, type(exc).__name__, exc)
                await self._sleep(delay)
        raise AssertionError("unreachable")

    def _mark_down(self, server: _ServerState, exc: TransportError) -> None:
        if time.monotonic() < server.retry_at:
            return  # a concurrent request already found it down: one failure, one backoff step
        server.failures += 1
        wait = compute_backoff(server.failures - 1, base=DOWN_BACKOFF.base, cap=DOWN_BACKOFF.cap)
        server.retry_at = time.monotonic() + wait
        with self._counts_lock:
            self._counts["server_down"] += 1
        # One line per failed retry of that server, at most one per backoff period.
        log.warning(
            "lm://%s is down (%s: %s); its keys miss for %.1fs", server.address, type(exc).__name__, exc, wait
        )

    def _unavailable(self, batch: Batch, exc: TransportError | None) -> list[Any]:
        """The ops' fallbacks (misses, dropped PUTs), or the error where one has none."""
        if any(op.fallback is None for op in batch.ops):
            address = self._servers[batch.server].address
            raise exc or ServerDown(f"lm://{address} is down; retrying it later")
        with self._counts_lock:
            self._counts["unavailable"] += len(batch.ops)
            self._counts["dropped_puts"] += sum(1 for op in batch.ops if op.interpret is None)
        return [op.fallback() for op in batch.ops if op.fallback is not None]

    # -- flows ------------------------------------------------------------------------

    def _single(self, op: Op[T]) -> Flow[T]:
        """One op on a key, in its key's lane."""
        results = yield Batch([op], server=self._placement.server(op.key), lane=self._placement.lane(op.key))
        return results[0]  # type: ignore[no-any-return]

    def _by_lane(self, keys: Iterable[str]) -> dict[tuple[int, int], list[int]]:
        """The indexes of ``keys`` by the (server, lane) each key travels on."""
        placement = self._placement
        lanes: dict[tuple[int, int], list[int]] = {}
        for index, key in enumerate(keys):
            lanes.setdefault((placement.server(key), placement.lane(key)), []).append(index)
        return lanes

    def _grouped(
        self, ops: Sequence[Op[Any]], window: int = EXIST_WINDOW, *, settle: bool = False
    ) -> Flow[list[Any]]:
        """Ops on keys, each in its key's lane: one pipelined batch (of at most ``window``
        ops) per lane, all lanes and servers at once; results in the ops' order. With
        ``settle``, an op that fails has its error as its result (see `Batch.settle`)."""
        batches: list[Batch] = []
        members: list[list[int]] = []
        for (server, lane), indexes in self._by_lane(op.key for op in ops).items():
            for start in range(0, len(indexes), window):
                part = indexes[start : start + window]
                batches.append(Batch([ops[i] for i in part], server=server, lane=lane, settle=settle))
                members.append(part)
        parts = yield batches
        results: list[Any] = [None] * len(ops)
        for part, got in zip(members, parts, strict=True):
            for index, result in zip(part, got, strict=True):
                results[index] = result
        return results

    def _everywhere(self, make: Callable[[], Op[T]], read_timeout: float | None = None) -> Flow[list[T]]:
        """One op (on no key) sent to every server; results in server order."""
        batches = [
            Batch([make()], read_timeout=read_timeout, server=index) for index in range(len(self._servers))
        ]
        parts = yield batches
        return [part[0] for part in parts]

    def _fences(self) -> Flow[None]:
        """Wait until every server has taken in every PUT already sent on any lane, so a
        command that reads many keys (LIST) sees them all."""
        batches = [
            Batch([self._commands.fence()], server=server, lane=lane)
            for server in range(len(self._servers))
            for lane in self._open_lanes(server)
        ]
        if batches:
            yield batches

    def _put_many_flow(
        self, keys: Sequence[str], data: Sequence[Any], ack: bool, settle: bool = False
    ) -> Flow[list[Any]]:
        if len(keys) != len(data):
            raise InvalidRequest(f"{len(keys)} keys but {len(data)} objects")
        put = self._commands.put
        ops = [put(k, d, None, ack) for k, d in zip(keys, data, strict=True)]
        return (yield from self._grouped(ops, settle=settle))

    def _get_many_flow(self, keys: Sequence[str], settle: bool = False) -> Flow[list[Any]]:
        return (yield from self._grouped([self._commands.get(k) for k in keys], settle=settle))

    def _get_many_into_flow(
        self, keys: Sequence[str], buffers: Sequence[Any], settle: bool = False
    ) -> Flow[list[Any]]:
        if len(keys) != len(buffers):
            raise InvalidRequest(f"{len(keys)} keys but {len(buffers)} buffers")
        ops = [self._commands.get_into(k, b) for k, b in zip(keys, buffers, strict=True)]
        return (yield from self._grouped(ops, settle=settle))

    def _delete_many_flow(self, keys: Iterable[str], settle: bool = False) -> Flow[list[Any]]:
        """One DELETE_MANY per lane holding some of the keys (in that lane, after the keys'
        earlier commands); pipelined DELETEs where a server lacks it (an older lmserver)."""
        keys = list(keys)
        results: list[Any] = [False] * len(keys)
        singly: list[int] = list(range(len(keys)))  # indexes deleted one DELETE each
        if keys and self._delete_many:
            lanes = self._by_lane(keys)
            batches = [
                Batch(
                    self._commands.delete_many([keys[i] for i in indexes]), server=s, lane=lane, settle=settle
                )
                for (s, lane), indexes in lanes.items()
            ]
            parts = yield batches
            singly = []
            for indexes, part in zip(lanes.values(), parts, strict=True):
                for start, answer in zip(range(0, len(indexes), EXIST_MANY_KEYS), part, strict=True):
                    members = indexes[start : start + EXIST_MANY_KEYS]
                    if answer is None:  # the server answered as to an unknown command
                        self._delete_many = False
                        singly += members
                        continue
                    outcomes = [answer] * len(members) if isinstance(answer, LMClientError) else answer
                    for index, outcome in zip(members, outcomes, strict=True):
                        results[index] = outcome
        if singly:
            ops = [self._commands.delete(keys[i]) for i in singly]
            for index, outcome in zip(singly, (yield from self._grouped(ops, settle=settle)), strict=True):
                results[index] = outcome
        return results

    def _put_tensor_op(self, key: str, tensor: torch.Tensor, fmt: int, ack: bool) -> Op[None]:
        from ._tensor import tensor_bytes, tensor_meta

        self._commands._require_v1("tensor helpers")
        return self._commands.put(key, tensor_bytes(tensor), tensor_meta(tensor, fmt), ack)

    def _get_tensor_op(self, key: str, into: torch.Tensor | None) -> Op[torch.Tensor | None]:
        from ._tensor import TensorSink

        return self._commands.get_tensor(key, TensorSink(into))

    def _health_flow(self) -> Flow[bool]:
        # Bounded by probe_timeout: a health check must answer quickly, and upstream v0
        # servers never answer HEALTH at all. Healthy means every server answers.
        try:
            answers = yield from self._everywhere(self._commands.health, self._settings.probe_timeout)
        except TransportError as exc:
            log.debug("health check failed: %s", exc)
            return False
        return all(answers)

    def _stats_flow(self) -> Flow[dict[str, Any]]:
        stats = yield from self._everywhere(self._commands.stats)
        if len(stats) == 1:
            return stats[0]
        return {str(state.address): part for state, part in zip(self._servers, stats, strict=True)}

    def _list_flow(self, prefix: str) -> Flow[list[str]]:
        yield from self._fences()
        parts = yield from self._everywhere(lambda: self._commands.list(prefix))
        if len(parts) == 1:
            return parts[0]
        return list(dict.fromkeys(key for part in parts for key in part))

    def _list_page_flow(self, prefix: str, after: str, limit: int) -> Flow[Page]:
        """The first ``limit`` keys (and sizes) after ``after`` over every server, and the
        cursor of the next page: each server's page is its own first keys after ``after``,
        so the merge of those pages holds the first ``limit`` of all."""
        yield from self._fences()
        parts = yield from self._everywhere(lambda: self._commands.list_page(prefix, after, limit))
        merged = sorted({key: size for entries, _ in parts for key, size in entries}.items())
        page = merged[:limit]
        more = len(merged) > limit or any(more for _, more in parts)
        entries = [(key, None if size == UNKNOWN_SIZE else size) for key, size in page]
        return entries, (page[-1][0] if more and page else None)

    def _exists_many_flow(self, keys: Iterable[str]) -> Flow[list[bool]]:
        keys = list(keys)
        if not keys:
            return []
        commands = self._commands
        if self._exist_many is not False:
            probing = self._exist_many is None
            # One EXIST_MANY per lane holding some of the keys, each in that lane, so it
            # is served after every earlier PUT of its keys (read-your-writes).
            lanes = self._by_lane(keys)
            batches = [
                Batch(commands.exist_many([keys[i] for i in indexes]), server=server, lane=lane)
                for (server, lane), indexes in lanes.items()
            ]
            parts: list[list[list[bool]]] = []
            if probing:  # one lane's request first: probe once, with a short timeout
                batches[0].probe, batches[0].read_timeout = True, self._settings.probe_timeout
                try:
                    parts.append((yield batches.pop(0)))
                except (ServerError, TransportError) as exc:
                    if not _means_unsupported(exc):
                        raise
                    log.info("server lacks EXIST_MANY (%s); using pipelined EXISTs", exc)
                    self._exist_many = False
                else:
                    self._exist_many = True
            if self._exist_many is not False:
                if batches:
                    parts += yield batches
                hits = [False] * len(keys)
                for indexes, part in zip(lanes.values(), parts, strict=True):
                    for index, hit in zip(indexes, (h for chunk in part for h in chunk), strict=True):
                        hits[index] = hit
                return hits
        return (yield from self._grouped([commands.exists(k) for k in keys]))
