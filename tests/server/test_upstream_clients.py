"""Byte-level emulation of LMCache's own clients, quirks included (reference/wire-facts.md):
header and body sent as two writes, reply headers read with a single ``recv(n)``, keys padded
with spaces by ``ljust``, v1 keys in CacheEngineKey form, HEALTH with an empty key."""

from __future__ import annotations

import socket
import struct
from typing import Any
from unittest import mock

import pytest

V0_REQ, V0_REP = struct.Struct("ii150s"), struct.Struct("ii")  # native order, as upstream packs
V1_REQ, V1_REP = struct.Struct("iiiiiiiii150s"), struct.Struct("iiiiiiiii")


@pytest.fixture
def sock(server_thread):
    s = socket.create_connection((server_thread.host, server_thread.port))
    yield s
    s.close()


def recv_all(s: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = s.recv(n - len(data))
        assert chunk
        data += chunk
    return data


def test_lmcache_v0_client(sock: socket.socket) -> None:
    key = "vllm@1@0@00ff"
    body = bytes(range(256)) * 64
    sock.sendall(V0_REQ.pack(1, len(body), key.encode().ljust(150)))  # PUT header ...
    sock.sendall(body)  # ... and body: two writes, no reply
    sock.sendall(V0_REQ.pack(3, 0, key.encode().ljust(150)))
    assert V0_REP.unpack(sock.recv(8)) == (200, 0)  # a single recv for the header
    sock.sendall(V0_REQ.pack(2, 0, key.encode().ljust(150)))
    code, length = V0_REP.unpack(sock.recv(8))
    assert (code, length) == (200, len(body)) and recv_all(sock, length) == body
    sock.sendall(V0_REQ.pack(2, 0, b"missing".ljust(150)))
    assert V0_REP.unpack(sock.recv(8)) == (400, 0)
    sock.sendall(V0_REQ.pack(4, 0, b"".ljust(150)))
    code, length = V0_REP.unpack(sock.recv(8))
    assert code == 200 and recv_all(sock, length).decode().split("\n") == [key]


def test_lmcache_v1_connector(sock: socket.socket) -> None:
    key = "meta-llama/Llama-3.1-8B@1@0@7d8f3a9c0b1e2f44@bfloat16"
    shape = (2, 16, 256, 128)
    body = b"\x3c" * (2 * 16 * 256 * 128 * 2 // 64)
    # MemoryFormat KV_2LTD (1), dtype bfloat16 (3), location LocalCPUBackend (1).
    sock.sendall(V1_REQ.pack(1, len(body), 1, 3, 1, *shape, key.encode().ljust(150)))
    sock.sendall(body)
    sock.sendall(V1_REQ.pack(3, 0, 1, 2, 0, 0, 0, 0, 0, key.encode().ljust(150)))
    assert V1_REP.unpack(sock.recv(36))[:2] == (200, 0)
    sock.sendall(V1_REQ.pack(2, 0, 1, 2, 0, 0, 0, 0, 0, key.encode().ljust(150)))
    code, length, fmt, dtype, s0, s1, s2, s3, location = V1_REP.unpack(sock.recv(36))
    assert (code, length, fmt, dtype, (s0, s1, s2, s3), location) == (200, len(body), 1, 3, shape, 1)
    assert recv_all(sock, length) == body
    sock.sendall(V1_REQ.pack(5, 0, 1, 2, 0, 0, 0, 0, 0, b"".ljust(150)))  # HEALTH, empty key
    assert V1_REP.unpack(sock.recv(36)) == (200, 0, 1, 2, 0, 0, 0, 0, 0)
    sock.sendall(V1_REQ.pack(2, 0, 1, 2, 0, 0, 0, 0, 0, b"absent@1@0@00@half".ljust(150)))
    assert V1_REP.unpack(sock.recv(36)) == (400, 0, 1, 2, 0, 0, 0, 0, 0)


@pytest.mark.skipif(not hasattr(socket, "TCP_QUICKACK"), reason="TCP_QUICKACK is Linux only")
async def test_a_put_without_a_reply_is_acknowledged_at_once() -> None:
    """Upstream's v0 client writes a PUT's header and body separately with Nagle on: its
    next write waits for our ACK, which delayed ACK would hold for up to 40 ms (24 PUT+GET
    pairs per second; `python -m bench.nagle`). A read that ends with a fire-and-forget PUT
    and no reply asks the kernel to ACK now; replies carry their own ACK."""
    from lmproto import Command, encode_request
    from lmserver.config import ServerConfig
    from lmserver.connection import LMProtocol
    from lmserver.server import Server

    server = Server(ServerConfig(host="127.0.0.1", port=0, memory_limit=1 << 26))
    await server.state.store.open()
    proto = LMProtocol(server.state)
    sock = mock.Mock()  # records setsockopt
    sock.fileno.return_value = -1  # no real socket: replies go through transport.write
    transport = mock.Mock()
    transport.get_extra_info.side_effect = {"peername": ("127.0.0.1", 1), "socket": sock}.get
    transport.get_write_buffer_size.return_value = 0
    transport.is_closing.return_value = False
    # What a transport returns: compiled (mypyc), the protocol checks that methods typed to
    # return None do (a Mock's methods return Mocks).
    for name in ("write", "writelines", "pause_reading", "resume_reading", "set_write_buffer_limits"):
        getattr(transport, name).return_value = None
    proto.connection_made(transport)
    quickack = mock.call(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)

    def feed(data: bytes) -> list[Any]:
        sock.setsockopt.reset_mock()
        view = proto.get_buffer(len(data))
        view[: len(data)] = data
        proto.buffer_updated(len(data))
        return list(sock.setsockopt.call_args_list)

    assert feed(encode_request(Command.PUT, "k", 100)) == [quickack]  # the body is still to come
    assert feed(b"x" * 100) == [quickack]  # stored; no reply will carry the ACK
    assert feed(encode_request(Command.GET, "k")) == []  # the reply carries it
    assert transport.write.call_args.args[0].endswith(b"x" * 100)
    assert feed(encode_request(Command.PUT_ACK, "k2", 3) + b"abc") == []  # answered too
