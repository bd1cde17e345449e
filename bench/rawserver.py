"""The physical-limit peer: a minimal threaded receiver/sender that stores nothing.

Strategy: it speaks just enough v0 framing for the same client code (``RawDriver``) to
drive it: PUT bodies go ``recv_into`` one preallocated buffer per connection, GET replies
with a preallocated buffer whose size is read from the bench key, EXIST always answers 200,
PUT_ACK answers 200, and command 900 streams ``count`` objects back to back with no
headers. Headers are parsed out of a 64 KiB staging buffer and the replies of one read
are sent together, so pipelined small requests are not penalised by a reply per syscall.
One thread per connection with blocking sockets: the lowest-overhead Python server shape
measured on this machine (see shared/reference/zerocopy.md).

Started with ``ring_bytes`` (the *store limit*, target ``store``), PUT bodies go instead
into a ring of pre-touched buffers of the object's size, ``ring_bytes`` of them in all per
size, each PUT into the next, and each GET is answered from the next: as a store must, it
writes every object into, and serves every object from, memory that is cold in the CPU
caches (a single reused buffer stays warm, which no store can match).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from multiprocessing.connection import Connection

from .drivers import RAW_STREAM, raw_size_of

HDR = struct.Struct("<ii150s")
REPLY = struct.Struct("<ii")
OK = REPLY.pack(200, 0)
STAGING = 1 << 16


def _grow(buf: bytearray, n: int) -> bytearray:
    if len(buf) >= n:
        return buf
    new = bytearray(n)
    for i in range(0, n, 4096):
        new[i] = 1
    return new


class Ring:
    """Per object size, buffers totalling ``ring_bytes`` (at least two), used in turn."""

    def __init__(self, ring_bytes: int) -> None:
        self.ring_bytes = ring_bytes
        self._rings: dict[int, tuple[list[bytearray], list[int]]] = {}
        self._lock = threading.Lock()

    def next(self, size: int) -> bytearray:
        with self._lock:
            ring = self._rings.get(size)
            if ring is None:
                count = max(2, self.ring_bytes // max(1, size))
                ring = self._rings[size] = ([_grow(bytearray(0), size) for _ in range(count)], [0])
            bufs, turn = ring
            turn[0] = (turn[0] + 1) % len(bufs)
            return bufs[turn[0]]


def _serve_conn(sock: socket.socket, ring: Ring | None = None) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stage = bytearray(STAGING)
    smv = memoryview(stage)
    body = bytearray(0)
    out = bytearray(0)
    r = w = 0
    try:
        while True:
            n = sock.recv_into(smv[w:])
            if not n:
                return
            w += n
            replies: list[bytes] = []
            while w - r >= HDR.size:
                cmd, length, raw = HDR.unpack_from(stage, r)
                r += HDR.size
                if cmd == RAW_STREAM:
                    if replies:
                        sock.sendall(b"".join(replies))
                        replies = []
                    out = _grow(out, length)
                    view = memoryview(out)[:length]
                    for _ in range(int(raw.strip(b" \x00") or b"0")):
                        sock.sendall(view)
                    continue
                if length:
                    body = ring.next(length) if ring is not None and cmd in (1, 101) else _grow(body, length)
                    bmv = memoryview(body)
                    take = min(w - r, length)
                    bmv[:take] = smv[r : r + take]
                    r += take
                    pos = take
                    while pos < length:
                        got = sock.recv_into(bmv[pos:length])
                        if not got:
                            return
                        pos += got
                if cmd == 2:
                    size = raw_size_of(raw.decode("utf-8", "replace").strip())
                    if ring is not None:  # each reply from the next cold buffer
                        src = ring.next(size)
                    else:
                        src = out = _grow(out, size)
                    if replies:
                        sock.sendall(b"".join(replies))
                        replies = []
                    sock.sendmsg([REPLY.pack(200, size), memoryview(src)[:size]])
                elif cmd in (3, 101, 5):
                    replies.append(OK)
                elif cmd != 1:
                    replies.append(REPLY.pack(400, 0))
            if replies:
                sock.sendall(b"".join(replies))
            if r == w:
                r = w = 0
            elif r > STAGING // 2:
                smv[: w - r] = smv[r:w]
                w -= r
                r = 0
    except OSError:
        return
    finally:
        with contextlib.suppress(OSError):
            sock.close()


def serve(conn: Connection, ring_bytes: int = 0) -> None:
    """Process entry point: bind 127.0.0.1 on a free port, report it, serve until told to stop.

    ``ring_bytes`` > 0: PUT bodies and GET replies cycle through that many bytes of buffers
    per object size (the store limit).
    """
    ring = Ring(ring_bytes) if ring_bytes else None
    lsock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(128)
    conn.send(lsock.getsockname()[1])

    def acceptor() -> None:
        while True:
            try:
                s, _ = lsock.accept()
            except OSError:
                return
            threading.Thread(target=_serve_conn, args=(s, ring), daemon=True).start()

    threading.Thread(target=acceptor, daemon=True).start()
    with contextlib.suppress(EOFError, OSError):
        conn.recv()
    lsock.close()
