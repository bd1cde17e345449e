"""The command logic both clients share: requests to send, replies to interpret, flows.

Strategy: an `Op` is one request (its header and body buffers) plus how to receive and
interpret its reply; a `Batch` is ops sent back to back on one connection (pipelined) and
retried together. A *flow* is a generator that yields batches and gets their results back
(or has the batch's error thrown in), which lets a command need several round trips
(EXIST_MANY with its fallback). `BaseClient` runs flows, with retries, in one coroutine
over two I/O primitives that `Client` and `AsyncClient` implement: that is all they add.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Self, TypeVar

from lmproto import (
    NO_META,
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
    decode_presence,
    encode_key_list,
    encode_request,
)

from ._config import (
    DEFAULT_PORT,
    DEFAULT_TIMEOUT,
    ExistManyMode,
    ProtocolName,
    Retry,
    Settings,
    Timeout,
    make_settings,
    parse_url,
    url_wants_tls,
)
from ._exceptions import (
    BufferTooSmall,
    ConnectError,
    ConnectTimeout,
    InvalidRequest,
    LMClientError,
    ProtocolError,
    ReadError,
    ReadTimeout,
    ServerError,
    TransportError,
    WriteError,
)
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
    """One request; ``interpret`` is None for a plain PUT, which gets no reply."""

    buffers: list[memoryview]
    interpret: Callable[[Received], T] | None
    sink: Sink = fresh_sink

    @property
    def expects_reply(self) -> bool:
        return self.interpret is not None


@dataclass(slots=True, eq=False)
class Batch:
    """Ops sent back to back on one connection; ``read_timeout`` overrides the client's."""

    ops: Sequence[Op[Any]]
    read_timeout: float | None = None
    probe: bool = False
    """The server may lack the command: only failures to connect are retried."""

    @property
    def leaves_put_unconfirmed(self) -> bool:
        """Whether a plain PUT follows the batch's last reply: the server has not yet
        confirmed (by answering something sent after it) that it has taken it in.

        Both clients send every request to a connection carrying an unconfirmed PUT, so
        the server takes them in after it: a read always sees the caller's earlier
        writes, whatever connection the pool would have chosen.
        """
        return bool(self.ops) and not self.ops[-1].expects_reply


Flow = Generator[Batch, list[Any], T]


def interpret(batch: Batch, received: Sequence[Received | None]) -> list[Any]:
    """Each op's result from its reply (None for a PUT); raises the first op's error."""
    return [
        None if op.interpret is None or rcv is None else op.interpret(rcv)
        for op, rcv in zip(batch.ops, received, strict=True)
    ]


def single(op: Op[T]) -> Flow[T]:
    results = yield Batch([op])
    return results[0]  # type: ignore[no-any-return]


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
        return Op(buffers, interpret, sink)

    def _keyed(self, key: str) -> str:
        if not key:
            raise InvalidRequest("key must not be empty")
        return key

    def put(self, key: str, data: Any, meta: ObjectMeta | None, ack: bool) -> Op[None]:
        if meta is not None and self.generation == Generation.V0:
            raise InvalidRequest("v0 frames carry no metadata; use protocol='v1'")
        command = Command.PUT_ACK if ack else Command.PUT
        interpret = _check_ok("PUT_ACK") if ack else None
        return self._op(command, interpret, self._keyed(key), readable_view(data), meta or NO_META)

    def get(self, key: str) -> Op[bytes | None]:
        return self._op(Command.GET, _body_bytes, self._keyed(key))

    def get_with_meta(self, key: str) -> Op[tuple[bytes, ObjectMeta] | None]:
        return self._op(Command.GET, _with_meta, self._keyed(key))

    def get_into(self, key: str, buffer: Any) -> Op[int | None]:
        view = writable_view(buffer)

        def into(reply: Reply) -> memoryview | LMClientError:
            return view if reply.length <= len(view) else BufferTooSmall(reply.length, len(view))

        return self._op(Command.GET, _body_length, self._keyed(key), sink=into)

    def get_tensor(self, key: str, sink: TensorSink) -> Op[torch.Tensor | None]:
        self._require_v1("tensor helpers")

        def interpret(received: Received) -> torch.Tensor | None:
            return None if _hit(received) is None else sink.tensor

        return self._op(Command.GET, interpret, self._keyed(key), sink=sink)

    def exists(self, key: str) -> Op[bool]:
        return self._op(Command.EXIST, _yes_no("EXIST", Status.FAIL), self._keyed(key))

    def exist_many(self, keys: Sequence[str]) -> list[Op[list[bool]]]:
        ops: list[Op[list[bool]]] = []
        for start in range(0, len(keys), EXIST_MANY_KEYS):
            chunk = keys[start : start + EXIST_MANY_KEYS]
            try:
                body = memoryview(encode_key_list(chunk))
            except LocalProtocolError as exc:
                raise InvalidRequest(str(exc)) from exc
            ops.append(self._op(Command.EXIST_MANY, _presence(len(chunk)), body=body))
        return ops

    def delete(self, key: str) -> Op[bool]:
        return self._op(Command.DELETE, _yes_no("DELETE", Status.NOT_FOUND), self._keyed(key))

    def list(self, prefix: str) -> Op[list[str]]:
        # lmserver filters by the prefix sent as the key; filter again for servers that don't.
        def keys(body: memoryview) -> list[str]:
            return [k for k in decode_key_lines(body) if k.startswith(prefix)]

        return self._op(Command.LIST, _decoded("LIST", keys), prefix)

    def health(self) -> Op[bool]:
        return self._op(Command.HEALTH, _health, HEALTH_KEY)

    def stats(self) -> Op[dict[str, Any]]:
        return self._op(Command.STATS, _decoded("STATS", decode_json))

    def _require_v1(self, what: str) -> None:
        if self.generation != Generation.V1:
            raise InvalidRequest(f"{what} need v1 metadata; this client speaks v0 (protocol='v0')")


def _presence(count: int) -> Callable[[Received], list[bool]]:
    def decode(body: memoryview) -> list[bool]:
        if len(body) != count:
            raise MalformedBody(f"{len(body)} presence bytes for {count} keys")
        return decode_presence(body)

    return _decoded("EXIST_MANY", decode)


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


class BaseClient:
    """Configuration, validation and flows of both clients; subclasses add only I/O."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        *,
        protocol: ProtocolName | Generation = "v1",
        timeout: float | Timeout = DEFAULT_TIMEOUT,
        retry: int | Retry = 3,
        max_connections: int = 4,
        exist_many: ExistManyMode = "auto",
        probe_timeout: float = 2.0,
        ssl: SslOption = None,
    ) -> None:
        self._settings: Settings = make_settings(
            host, port, protocol, timeout, retry, max_connections, exist_many, probe_timeout, ssl
        )
        self._commands = Commands(self._settings.generation)
        self._exist_many: bool | None = {"auto": None, "always": True, "never": False}[exist_many]
        self._closed = False
        self._init_io()

    def _init_io(self) -> None:
        raise NotImplementedError

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> Self:
        """A client for ``lm://host:port`` (LMCache's ``LMCACHE_REMOTE_URL`` form), or
        ``lms://host:port`` for TLS with the system's CAs (pass ``ssl=context`` for others)."""
        host, port = parse_url(url)
        if url_wants_tls(url):
            kwargs.setdefault("ssl", True)
        return cls(host, port, **kwargs)

    @property
    def settings(self) -> Settings:
        return self._settings

    def __repr__(self) -> str:
        s = self._settings
        state = "closed" if self._closed else "open"
        return f"<{type(self).__name__} lm://{s.host}:{s.port} {s.generation.name.lower()} {state}>"

    def _check_open(self) -> None:
        if self._closed:
            raise LMClientError(f"{type(self).__name__} is closed")

    # -- running flows: the one loop both clients use ---------------------------------
    #
    # Written once as coroutines over two I/O primitives, ``_exchange`` and ``_sleep``.
    # AsyncClient awaits them on its event loop; Client implements both as blocking calls
    # that never suspend, so it runs these coroutines to completion with a single
    # ``send(None)`` (see _sync.run_blocking), without an event loop.

    async def _exchange(self, batch: Batch) -> list[Received | None]:
        """Send ``batch`` on one connection and read its replies (None for a PUT)."""
        raise NotImplementedError

    async def _sleep(self, seconds: float) -> None:
        raise NotImplementedError

    async def _call(self, flow: Flow[T]) -> T:
        """Run ``flow``: each batch it yields goes to `_run`, its result or error back in."""
        try:
            batch = next(flow)
            while True:
                try:
                    results = await self._run(batch)
                except LMClientError as exc:
                    batch = flow.throw(exc)
                else:
                    batch = flow.send(results)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]

    async def _run(self, batch: Batch) -> list[Any]:
        """One batch's results, retried on fresh connections as the policy allows."""
        for attempt in itertools.count():
            try:
                return interpret(batch, await self._exchange(batch))
            except TransportError as exc:
                retryable = not batch.probe or isinstance(exc, ConnectError | ConnectTimeout)
                delay = self._settings.retry.delay(exc, attempt) if retryable else None
                if delay is None:
                    raise
                log.debug("retrying in %.3fs after %s: %s", delay, type(exc).__name__, exc)
                await self._sleep(delay)
        raise AssertionError("unreachable")

    # -- flows ------------------------------------------------------------------------

    def _put_tensor_op(self, key: str, tensor: torch.Tensor, fmt: int, ack: bool) -> Op[None]:
        from ._tensor import tensor_bytes, tensor_meta

        self._commands._require_v1("tensor helpers")
        return self._commands.put(key, tensor_bytes(tensor), tensor_meta(tensor, fmt), ack)

    def _get_tensor_op(self, key: str, into: torch.Tensor | None) -> Op[torch.Tensor | None]:
        from ._tensor import TensorSink

        return self._commands.get_tensor(key, TensorSink(into))

    def _health_flow(self) -> Flow[bool]:
        # Bounded by probe_timeout: a health check must answer quickly, and upstream v0
        # servers never answer HEALTH at all.
        batch = Batch([self._commands.health()], read_timeout=self._settings.probe_timeout)
        try:
            return bool((yield batch)[0])
        except TransportError as exc:
            log.debug("health check failed: %s", exc)
            return False

    def _exists_many_flow(self, keys: Iterable[str]) -> Flow[list[bool]]:
        keys = list(keys)
        if not keys:
            return []
        commands = self._commands
        if self._exist_many is not False:
            probing = self._exist_many is None
            timeout = self._settings.probe_timeout if probing else None
            ops = commands.exist_many(keys)
            try:
                parts = yield Batch(ops, read_timeout=timeout, probe=probing)
            except (ServerError, TransportError) as exc:
                if not (probing and _means_unsupported(exc)):
                    raise
                log.info("server lacks EXIST_MANY (%s); using pipelined EXISTs", exc)
                self._exist_many = False
            else:
                self._exist_many = True
                return [hit for part in parts for hit in part]
        hits: list[bool] = []
        for start in range(0, len(keys), EXIST_WINDOW):
            hits += yield Batch([commands.exists(k) for k in keys[start : start + EXIST_WINDOW]])
        return hits
