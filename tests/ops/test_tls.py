"""TLS listener and lmclient's lms:// / ssl=: certificates are made here, with `cryptography`."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable

import pytest
from pki import Pki
from serverthread import ServerThread

from lmclient import AsyncClient, Client, TransportError
from lmproto import REPLY_SIZE, Command, Generation, decode_reply, encode_request

BIG = 4 * 1024 * 1024


@pytest.fixture(params=["asyncio", "uvloop"])
def tls_server(
    request: pytest.FixtureRequest, make_server_thread: Callable[..., ServerThread], pki: Pki
) -> ServerThread:
    return make_server_thread(
        loop=request.param, tls_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key
    )


def pins(thread: ServerThread) -> list[int]:
    assert thread.server is not None
    memory = thread.server.state.store.memory
    return thread.call(lambda: [e.pins for s in memory._shards for e in s.entries.values()])  # type: ignore[no-any-return]


def test_round_trips_with_the_blocking_client(tls_server: ServerThread, pki: Pki) -> None:
    big = bytes(range(256)) * (BIG // 256)
    with Client.from_url(f"lms://127.0.0.1:{tls_server.tls_port}", ssl=pki.client_context()) as client:
        client.put("big", big, ack=True)
        client.put("small", b"s" * 100)  # fire-and-forget, then read back on the same connection
        assert client.get("small") == b"s" * 100
        assert client.get("big") == big
        into = bytearray(BIG)
        assert client.get_into("big", into) == BIG and into == big
        assert client.exists_many(["big", "small", "none"]) == [True, True, False]
        assert client.get("none") is None
    # The plain listener serves the same store at the same time.
    with Client("127.0.0.1", tls_server.port) as plain:
        assert plain.get("small") == b"s" * 100
    assert all(p == 0 for p in pins(tls_server))


def test_round_trips_with_the_async_client(tls_server: ServerThread, pki: Pki) -> None:
    big = bytes(range(256)) * (BIG // 256)

    async def main() -> None:
        async with AsyncClient(
            "127.0.0.1", tls_server.tls_port or 0, ssl=pki.client_context(), max_connections=2
        ) as client:
            await client.put("big", big, ack=True)
            results = await asyncio.gather(*(client.get("big") for _ in range(6)))
            assert all(r == big for r in results)
            await asyncio.gather(*(client.put(f"k{i}", b"v" * i) for i in range(1, 200)))
            assert await client.exists_many([f"k{i}" for i in range(1, 200)]) == [True] * 199
            assert await client.get("k150") == b"v" * 150

    asyncio.run(main())
    assert all(p == 0 for p in pins(tls_server))


def test_a_slow_reader_over_tls_gets_every_reply(tls_server: ServerThread, pki: Pki) -> None:
    """Pipelined large GETs to a client that reads late: the server's write side fills up,
    pauses, resumes, and releases every pin (the (1, 0) write-buffer limits on TLS)."""
    with Client("127.0.0.1", tls_server.port) as plain:
        plain.put("big", b"b" * BIG, ack=True)
    context = pki.client_context()
    raw = socket.create_connection(("127.0.0.1", tls_server.tls_port or 0), timeout=30)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # a small window fills fast
    with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
        sock.sendall(encode_request(Command.GET, "big", generation=Generation.V0) * 8)
        time.sleep(0.5)  # not a wait for anything: reading late is the behaviour under test
        for _ in range(8):
            header = bytearray()
            while len(header) < REPLY_SIZE[Generation.V0]:
                header += sock.recv(REPLY_SIZE[Generation.V0] - len(header))
            reply = decode_reply(bytes(header), Generation.V0)
            left = reply.length
            while left:
                left -= len(sock.recv(min(left, 1 << 20)))
            assert reply.length == BIG
    assert all(p == 0 for p in pins(tls_server))


def test_a_client_without_the_ca_is_refused(tls_server: ServerThread) -> None:
    with (
        Client("127.0.0.1", tls_server.tls_port or 0, ssl=True, retry=0) as client,
        pytest.raises(TransportError) as caught,
    ):
        client.get("x")
    assert isinstance(caught.value.__cause__, ssl.SSLCertVerificationError)


def test_the_wrong_host_name_is_refused(tls_server: ServerThread, pki: Pki) -> None:
    context = pki.client_context()
    with Client("localhost", tls_server.tls_port or 0, ssl=context, retry=0) as ok:
        assert ok.health()
    with (
        Client(socket.gethostname(), tls_server.tls_port or 0, ssl=context, retry=0) as client,
        pytest.raises(TransportError),
    ):
        client.get("x")


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_client_certificates_are_required_with_tls_client_ca(
    make_server_thread: Callable[..., ServerThread], pki: Pki, loop: str
) -> None:
    thread = make_server_thread(
        loop=loop, tls_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca
    )
    port = thread.tls_port or 0
    with Client("127.0.0.1", port, ssl=pki.client_context(with_cert=True)) as client:
        client.put("k", b"v", ack=True)
        assert client.get("k") == b"v"
    with (
        Client("127.0.0.1", port, ssl=pki.client_context(), retry=0) as anonymous,
        pytest.raises(TransportError),
    ):
        anonymous.get("k")

    async def async_anonymous() -> None:
        async with AsyncClient("127.0.0.1", port, ssl=pki.client_context(), retry=0) as client:
            await client.get("k")

    with pytest.raises(TransportError):
        asyncio.run(async_anonymous())


def test_tls_only(make_server_thread: Callable[..., ServerThread], pki: Pki) -> None:
    thread = make_server_thread(plain=False, tls_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key)
    assert thread.server is not None and thread.server._server is None
    with Client("127.0.0.1", thread.tls_port or 0, ssl=pki.client_context()) as client:
        client.put("k", b"v", ack=True)
        assert client.get("k") == b"v"


def test_tls_options_go_together(pki: Pki) -> None:
    from lmserver.config import ServerConfig

    with pytest.raises(ValueError, match="go together"):
        ServerConfig(tls_port=1)
    with pytest.raises(ValueError, match="needs a TLS listener"):
        ServerConfig(plain=False)
    with pytest.raises(ValueError, match="need --tls-port"):
        ServerConfig(tls_key=pki.server_key)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_allow_applies_to_the_tls_listener_before_the_handshake(
    make_server_thread: Callable[..., ServerThread], pki: Pki, loop: str
) -> None:
    thread = make_server_thread(
        loop=loop, tls_port=0, tls_cert=pki.server_cert, tls_key=pki.server_key, allow=("127.0.0.1/32",)
    )
    raw = socket.socket()
    raw.settimeout(10)
    raw.bind(("127.0.0.2", 0))
    raw.connect(("127.0.0.1", thread.tls_port or 0))
    # Closed at accept: the handshake never gets an answer (it used to complete first).
    with pytest.raises((ssl.SSLError, ConnectionError)):
        pki.client_context().wrap_socket(raw, server_hostname="127.0.0.1")
    raw.close()
    assert thread.server is not None
    counters = thread.server.state.counters
    assert thread.call(lambda: counters["connections_refused_not_allowed"]) == 1
    assert thread.call(lambda: counters.get("tls_handshake_failures", 0)) == 0  # none was begun
