"""The plain TCP transport (lmserver/plain.py) against asyncio's transport contract, with a
recording protocol on real loopback sockets, on uvloop and on the standard library's loop.

plain.py is loaded from its source under another name, as the C twins' tests do: a compiled
``PlainTransport`` takes only the server's own protocol, and the contract is the same code.
The server's whole suite runs over this transport too (every plain connection uses it)."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import importlib.util
import socket
import struct
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop

import lmserver
from lmproto import Command, encode_request

_SOURCE = Path(lmserver.__file__).parent / "plain.py"
_spec = importlib.util.spec_from_file_location("lmserver.plain_reference", _SOURCE)
assert _spec is not None and _spec.loader is not None
plain = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plain)

LOOPS = pytest.mark.parametrize(
    "loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop], ids=["uvloop", "asyncio"]
)
Loop = Callable[[], asyncio.AbstractEventLoop]


def run(loop_factory: Loop, main: Coroutine[Any, Any, None]) -> None:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(asyncio.wait_for(main, 30))


class Recorder(asyncio.BufferedProtocol):
    """Records what the transport calls; ``on_data`` (if set) runs on every read."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.buffer = bytearray(64 * 1024)
        self.received = bytearray()
        self.calls: list[str] = []
        self.lost = asyncio.get_running_loop().create_future()
        self.on_data: Callable[[Recorder], None] | None = None
        self.keep_open_on_eof = False
        self.refuse_connection = False  # connection_made raises

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.calls.append("made")
        if self.refuse_connection:
            raise ValueError("a bug in connection_made")

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.received += self.buffer[:nbytes]
        if self.on_data is not None:
            self.on_data(self)

    def eof_received(self) -> bool:
        self.calls.append("eof")
        return self.keep_open_on_eof

    def pause_writing(self) -> None:
        self.calls.append("pause")

    def resume_writing(self) -> None:
        self.calls.append("resume")

    def connection_lost(self, exc: Exception | None) -> None:
        self.calls.append("lost")
        self.lost.set_result(exc)


async def serve(
    setup: Callable[[Recorder], None] | None = None, *, on_data: Callable[[Recorder], None] | None = None
) -> tuple[Any, list[Recorder], int]:
    """A listener of recording protocols on 127.0.0.1 (each given ``on_data``, then passed to
    ``setup``); returns it, its protocols and the port."""
    protocols: list[Recorder] = []

    def factory() -> Recorder:
        protocol = Recorder()
        protocol.on_data = on_data
        if setup is not None:
            setup(protocol)
        protocols.append(protocol)
        return protocol

    listener = await plain.create_plain_server(factory, "127.0.0.1", 0, backlog=16)
    return listener, protocols, listener.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def connect(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def until(condition: Callable[[], bool]) -> None:
    """Wait for something the loop's callbacks change (the whole test runs under a timeout)."""
    while not condition():  # noqa: ASYNC110  # no event to wait on: the transport's own callbacks
        await asyncio.sleep(0.001)


async def first(protocols: list[Recorder]) -> Recorder:
    await until(lambda: bool(protocols))
    return protocols[0]


@contextlib.asynccontextmanager
async def replying(
    on_data: Callable[[Recorder], None],
) -> AsyncIterator[tuple[asyncio.StreamReader, Recorder]]:
    """A listener whose connections run ``on_data`` when bytes arrive, and one client that has
    sent some: yields the client's reader and the server side's protocol. The listener closes
    at the end; the connection is the client's to close (closing a listener leaves it open)."""
    listener, protocols, port = await serve(on_data=on_data)
    try:
        async with connect(port) as (reader, writer):
            writer.write(b"go")
            yield reader, await first(protocols)
    finally:
        listener.close()


@LOOPS
def test_reads_arrive_in_order_and_a_peer_eof_closes(loop_factory: Loop) -> None:
    async def main() -> None:
        listener, protocols, port = await serve()
        async with connect(port) as (reader, writer):
            payload = bytes(range(256)) * 4096  # 1 MiB: many reads, some filling the buffer
            writer.write(payload)
            await writer.drain()
            writer.write_eof()
            protocol = await first(protocols)
            assert await protocol.lost is None
            assert protocol.received == payload
            assert protocol.calls == ["made", "eof", "lost"]
            assert await reader.read() == b""  # closed on our side too
            assert protocol.transport.get_extra_info("socket").fileno() == -1  # and its socket
        listener.close()
        await listener.wait_closed()

    run(loop_factory, main())


@LOOPS
def test_unsent_writes_pause_the_protocol_and_close_waits_for_them(loop_factory: Loop) -> None:
    big = bytes(range(256)) * (16 * 4096)  # 16 MiB: more than the socket buffers hold

    def reply(protocol: Recorder) -> None:
        transport = protocol.transport
        transport.set_write_buffer_limits(high=0)
        transport.write(big[:1000])
        transport.writelines([memoryview(big)[1000:5000], big[5000:]])
        assert transport.get_write_buffer_size() > 0
        transport.close()  # after what was written
        assert transport.is_closing()

    async def main() -> None:
        async with replying(reply) as (reader, protocol):
            await until(lambda: "pause" in protocol.calls)
            assert protocol.calls == ["made", "pause"]
            assert await reader.read() == big
            assert await protocol.lost is None
            assert protocol.calls == ["made", "pause", "resume", "lost"]
            assert protocol.transport.get_write_buffer_size() == 0

    run(loop_factory, main())


@LOOPS
def test_abort_drops_unsent_writes(loop_factory: Loop) -> None:
    def reply_then_abort(protocol: Recorder) -> None:
        protocol.transport.write(bytes(16 * 1024 * 1024))
        protocol.transport.abort()
        protocol.transport.write(b"after")  # dropped, as asyncio does

    async def main() -> None:
        async with replying(reply_then_abort) as (reader, protocol):
            assert await protocol.lost is None
            received = 0
            with contextlib.suppress(ConnectionResetError):
                while chunk := await reader.read(1 << 20):
                    received += len(chunk)
            assert received < 16 * 1024 * 1024
            assert protocol.calls == ["made", "pause", "lost"]

    run(loop_factory, main())


@LOOPS
def test_write_eof_sends_the_end_and_keeps_reading(loop_factory: Loop) -> None:
    def answer_and_end(protocol: Recorder) -> None:
        if protocol.received == b"question":
            protocol.transport.write(b"answer")
            protocol.transport.write_eof()
            assert protocol.transport.can_write_eof()
            with pytest.raises(RuntimeError):
                protocol.transport.write(b"more")

    async def main() -> None:
        listener, protocols, port = await serve(on_data=answer_and_end)
        async with connect(port) as (reader, writer):
            writer.write(b"question")
            assert await reader.read() == b"answer"  # then our end of the stream
            protocol = await first(protocols)
            writer.write(b" and after")
            await writer.drain()
            writer.write_eof()
            assert await protocol.lost is None
            assert protocol.received == b"question and after"
        listener.close()

    run(loop_factory, main())


@LOOPS
def test_paused_reading_reads_nothing_until_resumed(loop_factory: Loop) -> None:
    def pause_at_once(protocol: Recorder) -> None:
        protocol.transport.pause_reading()

    async def main() -> None:
        listener, protocols, port = await serve(on_data=pause_at_once)
        async with connect(port) as (_, writer):
            writer.write(b"first")
            protocol = await first(protocols)
            await until(lambda: bool(protocol.received))
            writer.write(b"second")
            await writer.drain()
            await asyncio.sleep(0.1)  # time to read it, if reading were not paused
            assert protocol.received == b"first" and not protocol.transport.is_reading()
            protocol.on_data = None
            protocol.transport.resume_reading()
            await until(lambda: protocol.received == b"firstsecond")
        await protocol.lost
        listener.close()

    run(loop_factory, main())


@LOOPS
def test_a_failing_protocol_is_reported_and_closes_only_its_connection(loop_factory: Loop) -> None:
    def fail_on_boom(protocol: Recorder) -> None:
        if protocol.received.endswith(b"boom"):
            raise RuntimeError("a bug in the protocol")

    async def main() -> None:
        reports: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context))
        listener, protocols, port = await serve(on_data=fail_on_boom)
        async with connect(port) as (reader, writer), connect(port) as (_, other_writer):
            await until(lambda: len(protocols) == 2)
            writer.write(b"boom")
            await until(lambda: any(p.lost.done() for p in protocols))
            failed, other = sorted(protocols, key=lambda p: not p.lost.done())
            assert isinstance(failed.lost.result(), RuntimeError)
            assert [r["message"] for r in reports] == ["Fatal error on transport (buffer_updated)"]
            assert await reader.read() == b""
            other_writer.write(b"still here")
            await until(lambda: other.received == b"still here")
        listener.close()

    run(loop_factory, main())


@LOOPS
@pytest.mark.parametrize("error", [errno.EMFILE, errno.EPERM], ids=["out-of-descriptors", "other"])
def test_accepting_goes_on_after_a_failed_accept(
    loop_factory: Loop, error: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Out of descriptors (or memory), accepting pauses ACCEPT_RETRY_S and resumes; another
    error is logged and the next connection accepted."""
    monkeypatch.setattr(plain, "ACCEPT_RETRY_S", 0.05)
    failures = [OSError(error, "refused by the test")]

    class Refusing(socket.socket):
        def accept(self) -> Any:
            if failures:
                raise failures.pop()
            return super().accept()

    async def main() -> None:
        protocols: list[Recorder] = []

        def factory() -> Recorder:
            protocols.append(Recorder())
            return protocols[-1]

        sock = Refusing()
        sock.bind(("127.0.0.1", 0))
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        listener = plain.PlainListener(
            loop, [sock], lambda conn, peer: plain.PlainTransport(loop, conn, peer, factory()).start(), 16
        )
        listener.start()
        async with connect(sock.getsockname()[1]):
            await first(protocols)
            assert not failures  # it failed once, and accepted the connection after that
        await protocols[0].lost
        listener.close()

    run(loop_factory, main())


def test_listening_on_a_busy_port_says_which_address() -> None:
    async def main() -> None:
        listener, _, port = await serve()
        expected = f"error while attempting to bind on address \\('127.0.0.1', {port}\\)"
        with pytest.raises(OSError, match=expected):
            await plain.create_plain_server(Recorder, "127.0.0.1", port, backlog=1)
        listener.close()

    run(uvloop.new_event_loop, main())


def test_the_server_serves_plain_connections_on_its_own_transport(
    make_server_thread: Callable[..., Any],
) -> None:
    thread = make_server_thread()
    with socket.create_connection((thread.server.host, thread.server.port)) as client:
        client.sendall(encode_request(Command.HEALTH, "k"))
        assert client.recv(1024)
        (connection,) = thread.server.state.connections
        assert type(connection.transport).__module__ == "lmserver.plain"
        assert type(connection.transport).__name__ == "PlainTransport"


@LOOPS
@pytest.mark.parametrize("where", ["connection_made", "get_buffer"])
def test_a_protocol_failing_before_it_reads_is_reported_and_closed(loop_factory: Loop, where: str) -> None:
    """connection_made raising, or get_buffer giving an empty buffer: reported, the
    connection closed (connection_lost once), the listener still serving."""

    def break_it(protocol: Recorder) -> None:
        if where == "connection_made":
            protocol.refuse_connection = True
        else:
            protocol.buffer = bytearray()

    async def main() -> None:
        reports: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context))
        listener, protocols, port = await serve(break_it)
        async with connect(port) as (reader, writer):
            writer.write(b"anything")
            protocol = await first(protocols)
            assert isinstance(await protocol.lost, ValueError)
            assert [r["message"] for r in reports] == [f"Fatal error on transport ({where})"]
            with contextlib.suppress(ConnectionResetError):  # closed with "anything" unread: RST
                assert await reader.read() == b""
        listener.close()

    run(loop_factory, main())


@LOOPS
def test_a_peer_that_resets_while_replies_are_queued_loses_them_quietly(loop_factory: Loop) -> None:
    """A send error (the peer reset the connection) closes the transport with that error as
    connection_lost's argument, and reports nothing: a peer going away is not a bug."""

    def flood(protocol: Recorder) -> None:
        protocol.transport.write(bytes(32 * 1024 * 1024))

    async def main() -> None:
        reports: list[dict[str, Any]] = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: reports.append(context))
        listener, protocols, port = await serve(on_data=flood)
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(b"go")
        protocol = await first(protocols)
        await until(lambda: protocol.transport.get_write_buffer_size() > 0)
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        raw.close()  # unread data and linger 0: RST
        assert isinstance(await protocol.lost, OSError)
        assert protocol.transport.get_write_buffer_size() == 0
        assert reports == []
        listener.close()

    run(loop_factory, main())


def test_listening_on_a_name_binds_every_address_it_resolves_to() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        try:
            listener = await plain.create_plain_server(Recorder, "localhost", 0, backlog=4)
        except OSError:
            pytest.skip("localhost resolves to an address this host cannot bind")
        families = sorted(s.family for s in listener.sockets)
        assert families == sorted({info[0] for info in infos})
        listener.close()
        assert listener.sockets == []

    run(uvloop.new_event_loop, main())


@LOOPS
def test_writes_queued_behind_a_full_socket_pause_the_protocol_past_the_high_mark(loop_factory: Loop) -> None:
    """Past the high-water mark the protocol is paused even when the bytes that cross it are
    queued behind others (the socket already full), and resumed at the low mark."""

    def reply(protocol: Recorder) -> None:
        transport = protocol.transport
        transport.set_write_buffer_limits(high=48 * 1024 * 1024)
        transport.write(bytes(32 * 1024 * 1024))  # fills the socket: the rest is queued
        assert protocol.calls == ["made"]  # below the high mark
        transport.write(bytes(32 * 1024 * 1024))  # queued behind: now past it
        assert protocol.calls == ["made", "pause"]

    async def main() -> None:
        async with replying(reply) as (reader, protocol):
            await until(lambda: "pause" in protocol.calls)
            assert len(await reader.readexactly(64 * 1024 * 1024)) == 64 * 1024 * 1024
            await until(lambda: "resume" in protocol.calls)
            assert protocol.transport.get_write_buffer_size() == 0
        await protocol.lost

    run(loop_factory, main())
