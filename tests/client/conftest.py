"""Fixtures for the client tests: both clients behind one interface, and fake peers.

``make_client(host, port, **kwargs)`` is parametrized over ``Client`` and ``AsyncClient``;
the async one is wrapped in `BlockingAdapter`, which runs each coroutine on a private
event loop, so a single test body checks both clients. ``client`` adds both generations
against a real in-process lmserver (``server_thread`` from tests/conftest.py).

Fake peers, each a plain socket listener on loopback served by threads, for what a real
lmserver never does (fixtures ``silent_server``, ``fake_upstream``, ``drop_first_relay``):

* `SilentServer`: accepts connections and never reads or answers (timeouts).
* `UnansweredPort` (fixture ``unanswered_port``): connections are never accepted (a host
  that is down: connect timeouts).
* `FakeUpstream`: an upstream-like lm:// server built on lmproto: PUT/GET/EXIST/LIST only,
  and on an extension command either answers 400 (``mode="fail"``) or goes silent on that
  connection (``mode="silent"``, as upstream's v0 server does); ``mode="delete"`` also
  answers DELETE, as an lmserver that predates DELETE_MANY does.
* `DropFirstRelay`: cuts its first connection after the first bytes of a request, then
  relays every later connection to a real server (a server that dies mid-exchange).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lmclient import AsyncClient, Client
from lmproto import (
    NEED_DATA,
    Command,
    Generation,
    RequestDecoder,
    Status,
    encode_key_lines,
    encode_reply,
)


class BlockingAdapter:
    """An AsyncClient whose coroutine methods are called like Client's blocking ones."""

    def __init__(self, client: AsyncClient) -> None:
        self.inner = client
        self.loop = asyncio.new_event_loop()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.loop.run_until_complete(attr(*args, **kwargs))

        return call

    def close(self) -> None:
        self.loop.run_until_complete(self.inner.aclose())


@pytest.fixture(params=["sync", "async"])
def flavor(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def make_client(flavor: str) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(host: str, port: int, **kwargs: Any) -> Any:
        client: Any = Client(host, port, **kwargs)
        if flavor == "async":
            client = BlockingAdapter(AsyncClient(host, port, **kwargs))
        made.append(client)
        return client

    yield make
    for client in made:
        client.close()
        if isinstance(client, BlockingAdapter):
            client.loop.close()


@pytest.fixture(params=["v0", "v1"])
def protocol(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def client(make_client: Callable[..., Any], server_thread: Any, protocol: str) -> Any:
    """A sync or async client of a real lmserver, in either frame generation."""
    return make_client(server_thread.host, server_thread.port, protocol=protocol)


@pytest.fixture
def silent_server() -> Iterator[SilentServer]:
    with SilentServer() as server:
        yield server


@pytest.fixture
def unanswered_port() -> Iterator[UnansweredPort]:
    port = UnansweredPort()
    yield port
    port.close()


@pytest.fixture
def fake_upstream() -> Iterator[Callable[[Generation, str], FakeUpstream]]:
    made: list[FakeUpstream] = []

    def make(generation: Generation, mode: str) -> FakeUpstream:
        made.append(FakeUpstream(generation, mode))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def drop_first_relay() -> Iterator[Callable[[Any], DropFirstRelay]]:
    made: list[DropFirstRelay] = []

    def make(server: Any) -> DropFirstRelay:
        made.append(DropFirstRelay((server.host, server.port)))
        return made[-1]

    yield make
    for relay in made:
        relay.close()


# ---------------------------------------------------------------------------------------
# fake peers


class _Listener:
    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.host, self.port = self.sock.getsockname()[:2]
        self.stopping = threading.Event()
        self.conns: list[socket.socket] = []
        self.accepted = 0
        self.threads = [threading.Thread(target=self._accept_loop, daemon=True)]
        self.threads[0].start()

    def _accept_loop(self) -> None:
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self.conns.append(conn)
            self.on_connection(conn, self.accepted)

    def on_connection(self, conn: socket.socket, number: int) -> None:
        pass

    def spawn(self, target: Any, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        self.threads.append(thread)
        thread.start()

    def close(self) -> None:
        self.stopping.set()
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv
            conn.close()
        self.sock.close()
        for thread in self.threads:
            thread.join(5)

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SilentServer(_Listener):
    """Accepts and holds connections; reads nothing, answers nothing."""


class UnansweredPort:
    """A port whose SYNs go unanswered, as a host that is down (or behind a cut link) looks
    to a client: a listener that never accepts, its backlog filled by other connections."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=0)
        self.host, self.port = self.listener.getsockname()[:2]
        self.fillers: list[socket.socket] = []
        for _ in range(8):
            filler = socket.socket()
            filler.setblocking(False)
            filler.connect_ex((self.host, self.port))
            self.fillers.append(filler)

    def close(self) -> None:
        for filler in self.fillers:
            filler.close()
        self.listener.close()


class FakeUpstream(_Listener):
    def __init__(self, generation: Generation, mode: str) -> None:
        self.generation = generation
        self.mode = mode
        self.store: dict[str, bytes] = {}
        self.commands: list[int] = []
        super().__init__()

    def on_connection(self, conn: socket.socket, number: int) -> None:
        conn.settimeout(0.05)
        self.spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        decoder = RequestDecoder(self.generation)
        while not self.stopping.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            decoder.feed(data)
            while (frame := decoder.next_frame()) is not NEED_DATA:
                request, body = frame
                self.commands.append(request.command)
                reply = self._answer(request.command, request.key, body)
                if reply is None:
                    continue
                if reply is False:  # silent from now on, like upstream on unknown commands
                    return
                conn.sendall(reply)

    def _answer(self, command: int, key: str, body: bytes) -> bytes | bool | None:
        def reply(status: int, payload: bytes = b"") -> bytes:
            return encode_reply(status, len(payload), generation=self.generation) + payload

        if command == Command.PUT:
            self.store[key] = body
            return None
        if command == Command.GET:
            return reply(200, self.store[key]) if key in self.store else reply(400)
        if command == Command.EXIST:
            return reply(200 if key in self.store else 400)
        if command == Command.LIST:
            return reply(200, encode_key_lines(self.store))
        if command == Command.DELETE and self.mode == "delete":
            return reply(Status.SUCCESS if self.store.pop(key, None) is not None else Status.NOT_FOUND)
        return reply(Status.FAIL) if self.mode in ("fail", "delete") else False


class DropFirstRelay(_Listener):
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        super().__init__()

    def on_connection(self, conn: socket.socket, number: int) -> None:
        if number == 1:
            conn.settimeout(5)
            conn.recv(1)  # the request has begun to arrive: now the "server" dies
            conn.close()
            return
        upstream = socket.create_connection(self.target)
        self.conns.append(upstream)
        self.spawn(self._pump, conn, upstream)
        self.spawn(self._pump, upstream, conn)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
