"""A raw-socket peer for server tests: sends exact frames, reads exact replies."""

from __future__ import annotations

import socket
import time
from collections import Counter
from typing import Any

from lmproto import (
    NO_META,
    REPLY_SIZE,
    V0_REQUEST,
    Command,
    Generation,
    ObjectMeta,
    Reply,
    decode_reply,
    encode_request,
)


class Wire:
    def __init__(
        self, host: str, port: int, generation: Generation = Generation.V0, timeout: float = 10
    ) -> None:
        self.generation = generation
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def __enter__(self) -> Wire:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def frame(self, command: int, key: str = "", body: bytes = b"", meta: ObjectMeta = NO_META) -> bytes:
        return encode_request(command, key, len(body), generation=self.generation, meta=meta) + body

    def send(self, command: int, key: str = "", body: bytes = b"", meta: ObjectMeta = NO_META) -> None:
        self.sock.sendall(self.frame(command, key, body, meta))

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv_exactly(self, n: int) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self.sock.recv_into(view[got:])
            if not k:
                raise ConnectionError(f"closed after {got} of {n} bytes")
            got += k
        return bytes(buf)

    def reply(self) -> tuple[Reply, bytes]:
        header = decode_reply(self.recv_exactly(REPLY_SIZE[self.generation]), self.generation)
        return header, self.recv_exactly(header.length)

    def call(
        self, command: int, key: str = "", body: bytes = b"", meta: ObjectMeta = NO_META
    ) -> tuple[Reply, bytes]:
        self.send(command, key, body, meta)
        return self.reply()

    def put(self, key: str, body: bytes, meta: ObjectMeta = NO_META) -> None:
        """Acknowledged PUT, so the test knows it is stored."""
        reply, text = self.call(Command.PUT_ACK, key, body, meta)
        assert reply.status == 200, (reply, text)

    def get(self, key: str) -> bytes | None:
        reply, body = self.call(Command.GET, key)
        return body if reply.status == 200 else None

    def is_closed(self, timeout: float = 5) -> bool:
        """True once the server has closed this connection."""
        self.sock.settimeout(timeout)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def stats(server: Any) -> Counter[str]:
    """A ServerThread's counters and memory usage; absent counters read as 0."""
    state = server.server.state
    return server.call(  # type: ignore[no-any-return]
        lambda: Counter({**state.current_counters(), **state.store.memory.usage()})
    )


def wait_until(predicate: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.01)


def connect_from(source: str, port: int) -> socket.socket:
    """A connection to 127.0.0.1:port whose source address is ``source`` (all of 127/8 is lo)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def health(sock: socket.socket) -> int:
    sock.sendall(encode_request(Command.HEALTH, generation=Generation.V0))
    header = b""
    while len(header) < REPLY_SIZE[Generation.V0]:
        chunk = sock.recv(REPLY_SIZE[Generation.V0] - len(header))
        assert chunk, "closed"
        header += chunk
    return decode_reply(header, Generation.V0).status


def closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def raw_v0(command: int, length: int, key: bytes) -> bytes:
    return V0_REQUEST.pack(command, length, key.ljust(150, b" "))
