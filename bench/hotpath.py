"""Per-request Python cost of the connection's hot path, in process: ``python -m bench.hotpath``.

Strategy: one ``LMProtocol`` on a real Store, fed request frames through
``get_buffer``/``buffer_updated`` as the event loop would, replies sent on a real loopback
socket (straight or through a stand-in transport, as the connection chooses) and read back.
No event loop, no wakeups, no reads from the request socket: what is left is the Python work
per request and the kernel's send, the part that compiled code or fewer steps can shrink. It
also measures where copying a small GET reply into the reply buffer stops beating pinning the
object and writing two buffers (``LMProtocol.small_reply``, default ``SMALL_REPLY`` in
lmserver/connection/replies.py): the rows ``get copy`` and ``get pin``.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import time
from typing import Any

from lmproto import Command, Generation, ObjectMeta, encode_request
from lmserver.config import ServerConfig
from lmserver.connection import LMProtocol
from lmserver.connection.replies import SMALL_REPLY
from lmserver.logs import configure_logging
from lmserver.server import Server


class _Transport:
    """A transport over a real loopback TCP socket, whose peer ``feed`` drains after every
    burst: replies the connection sends straight to the socket and those it writes through
    the transport both go through the kernel, as on a live server (the kernel's work is not in
    valgrind's count; its time is in the timings)."""

    __module__ = "uvloop.stand_in"  # treated like uvloop's transport (writes are not copied)

    def __init__(self) -> None:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            self.peer = socket.create_connection(listener.getsockname())
            self.sock, _ = listener.accept()
        # Room for the largest burst of replies, so that no send is ever partial.
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
        self.peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        self.written = 0  # bytes of replies the peer has received
        self._sink = bytearray(8 << 20)

    def drain(self) -> None:
        while True:
            try:
                got = self.peer.recv_into(self._sink, 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            self.written += got
            if got < len(self._sink):
                return  # loopback delivers a send before it returns: nothing more is coming

    def write(self, data: Any) -> None:
        self.sock.sendall(data)

    def writelines(self, parts: Any) -> None:
        sent, size = self.sock.sendmsg(parts), sum(map(len, parts))
        if sent != size:
            raise RuntimeError(f"a partial writev ({sent} of {size} bytes)")

    def get_write_buffer_size(self) -> int:
        return 0

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 1), "socket": self.sock}.get(name, default)

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def feed(proto: LMProtocol, data: bytes) -> None:
    """Deliver ``data`` as the event loop would: into ``get_buffer``, then ``buffer_updated``;
    then read the replies on the peer's side."""
    view = proto.get_buffer(len(data))
    view[: len(data)] = data
    proto.buffer_updated(len(data))
    proto.transport.drain()  # type: ignore[union-attr]


async def hot_connection(
    command: Command, size: int, depth: int, small_reply: int = SMALL_REPLY
) -> tuple[LMProtocol, bytes]:
    """A connection on a fresh store holding one ``size``-byte object, and a burst of
    ``depth`` ``command`` requests for it to feed it."""
    server = Server(ServerConfig(host="127.0.0.1", port=0, memory_limit=1 << 30))
    await server.state.store.open()
    proto = LMProtocol(server.state)
    proto.small_reply = small_reply
    proto.connection_made(_Transport())  # type: ignore[arg-type]
    meta = ObjectMeta(1, 2, (3, 4, 5, 6), 7)
    put = encode_request(Command.PUT, "hot-key", size, generation=Generation.V1, meta=meta)
    feed(proto, put)
    body = bytes(size)
    for start in range(0, size, 32 * 1024):  # as a socket delivers it
        feed(proto, body[start : start + 32 * 1024])
    return proto, encode_request(command, "hot-key", generation=Generation.V1) * depth


async def _measure(
    command: Command, size: int, depth: int, requests: int, small_reply: int = SMALL_REPLY
) -> float:
    proto, batch = await hot_connection(command, size, depth, small_reply)
    rounds = max(1, requests // depth)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(rounds):
            feed(proto, batch)
        best = min(best, time.perf_counter() - began)
    return best / (rounds * depth) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32000)
    args = parser.parse_args()
    configure_logging("warning")  # no line per connection between the rows
    rows: list[tuple[str, int, int, float]] = []
    for depth in (1, 16):
        rows.append(("exist", 0, depth, asyncio.run(_measure(Command.EXIST, 4096, depth, args.requests))))
    for size in (1024, 4096, 16 * 1024, 64 * 1024, 256 * 1024):
        for mode, threshold in (("copy", 1 << 30), ("pin", -1)):
            us = asyncio.run(_measure(Command.GET, size, 1, args.requests // 4, threshold))
            rows.append((f"get {mode}", size, 1, us))
    print("| request | object bytes | depth | µs per request |")
    print("|---|---|---|---|")
    for name, size, depth, us in rows:
        print(f"| {name} | {size or '-'} | {depth} | {us:.2f} |")


if __name__ == "__main__":
    main()
