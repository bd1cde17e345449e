"""Protocol drivers: the only part of the client code that differs between targets.

Strategy: every driver works on one blocking socket with ``TCP_NODELAY`` and exposes the
same batch operations (``put``, ``put_pipelined``, ``get``, ``exist``; a batch of one is a
sequential request). Request headers are built once per key before the timed loop, bodies
are sent with ``sendmsg([header, body])`` (no concatenation) and received with
``recv_into`` straight into a preallocated buffer. Small replies are read through a 64 KiB
staging buffer so a pipelined burst of replies costs a few ``recv_into`` calls.

The worker (``bench.worker``) drives these; it never looks at protocol bytes itself.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmproto import (
    REPLY_SIZE,
    Command,
    DType,
    Generation,
    Location,
    MemoryFormat,
    ObjectMeta,
    Status,
    decode_reply,
    encode_request,
)

STAGING = 1 << 16
RAW_STREAM = 900
"""Command understood only by the raw (physical limit) server: stream ``key`` objects of ``length`` bytes."""


@dataclass(frozen=True)
class TargetSpec:
    """Where and how a worker connects; picklable so it crosses the process boundary."""

    kind: str  # "lm", "raw" or "resp"
    host: str
    port: int
    generation: int = 0  # lm only: 0 or 1
    put_ack: bool = False  # lm only: server answers PUT_ACK (101)


def bench_key(cid: int, size: int, j: int) -> str:
    """A key upstream's v1 server also accepts: ``model@world_size@worker_id@chunk_hash@dtype``.

    The hash field is hex and starts with the object size, which the raw server reads back.
    """
    return f"lmbench@1@{cid}@{size:08x}{j:08x}@half"


def raw_size_of(key: str) -> int:
    """The object size encoded in a bench key (used by the raw server's GET)."""
    try:
        return int(key.split("@")[3][:8], 16)
    except (IndexError, ValueError):
        return 0


class Reader:
    """Exact reads from a blocking socket through a staging buffer; big bodies bypass it."""

    def __init__(self, sock: socket.socket, cap: int = STAGING) -> None:
        self.sock = sock
        self.buf = bytearray(cap)
        self.mv = memoryview(self.buf)
        self.r = 0
        self.w = 0

    def _fill(self, need: int) -> None:
        if self.r == self.w:
            self.r = self.w = 0
        elif len(self.buf) - self.r < need:
            n = self.w - self.r
            self.mv[:n] = self.mv[self.r : self.w]
            self.r, self.w = 0, n
        while self.w - self.r < need:
            n = self.sock.recv_into(self.mv[self.w :])
            if not n:
                raise ConnectionError("server closed the connection")
            self.w += n

    def read(self, n: int) -> memoryview:
        """The next ``n`` bytes (n <= staging size); valid until the next call."""
        self._fill(n)
        view = self.mv[self.r : self.r + n]
        self.r += n
        return view

    def readinto(self, dest: memoryview) -> None:
        """Fill all of ``dest``: what is staged first, then ``recv_into`` straight into it."""
        want = len(dest)
        take = min(self.w - self.r, want)
        if take:
            dest[:take] = self.mv[self.r : self.r + take]
            self.r += take
        pos = take
        while pos < want:
            n = self.sock.recv_into(dest[pos:])
            if not n:
                raise ConnectionError("server closed the connection")
            pos += n

    def readline(self) -> bytes:
        """One CRLF-terminated line, without the CRLF."""
        while True:
            end = self.buf.find(b"\r\n", self.r, self.w)
            if end >= 0:
                line = bytes(self.mv[self.r : end])
                self.r = end + 2
                return line
            self._fill(self.w - self.r + 1)


def _connect(host: str, port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(60.0)
    return sock


def _sendmsg_all(sock: socket.socket, parts: list[memoryview | bytes]) -> None:
    """sendmsg with a gather list, continuing after partial sends."""
    total = sum(len(p) for p in parts)
    sent = sock.sendmsg(parts)
    if sent == total:
        return
    views = [memoryview(p) for p in parts]
    while sent < total:
        while sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        views[0] = views[0][sent:]
        total = sum(len(v) for v in views)
        sent = sock.sendmsg(views)


class Driver:
    """Common shape of a protocol driver; see the module docstring."""

    name = "driver"

    def _fixed_replies(self, count: int, size: int, tally: Callable[[memoryview, int], int]) -> int:
        """Read ``count`` replies of ``size`` bytes each, a staging buffer's worth at a time;
        ``tally(view, n)`` checks n replies at once and returns how many were hits.

        A pipelined burst of EXISTs is parsed in bulk, for every protocol alike, so that a deep
        pipeline measures the server rather than this client's per-reply Python.
        """
        hits = 0
        per_read = STAGING // size
        while count:
            n = min(count, per_read)
            hits += tally(self.reader.read(n * size), n)
            count -= n
        return hits

    def _skip(self, n: int) -> None:
        """Read and drop ``n`` reply bytes."""
        while n > 0:
            step = min(n, STAGING)
            self.reader.read(step)
            n -= step

    def _read_body(self, n: int, dest: memoryview) -> None:
        """A reply body of ``n`` bytes into ``dest`` when it fits, else read and dropped."""
        if n <= len(dest):
            self.reader.readinto(dest[:n])
        else:
            self._skip(n)

    def __init__(self, spec: TargetSpec) -> None:
        self.spec = spec
        self.sock = _connect(spec.host, spec.port)
        self.reader = Reader(self.sock)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def prepare(self, keys: Sequence[str], size: int) -> None:
        raise NotImplementedError

    def put(self, idxs: Sequence[int], body: memoryview) -> int:
        """Store ``body`` under each key, one acknowledgement per object; returns acks that succeeded."""
        raise NotImplementedError

    def put_pipelined(self, idxs: Sequence[int], body: memoryview) -> int:
        """Store ``body`` under each key as one pipelined burst ending with a round trip."""
        raise NotImplementedError

    def get(self, idxs: Sequence[int], dest: memoryview) -> tuple[int, int]:
        """Fetch each key into ``dest`` (requests sent together); returns (hits, body bytes)."""
        raise NotImplementedError

    def exist(self, idxs: Sequence[int]) -> int:
        """Ask whether each key exists (requests sent together); returns hits."""
        raise NotImplementedError


class LmDriver(Driver):
    """LMCache ``lm://`` frames (v0 or v1) built with lmproto."""

    name = "lm"

    def __init__(self, spec: TargetSpec) -> None:
        super().__init__(spec)
        self.gen = Generation(spec.generation)
        self.reply_size = REPLY_SIZE[self.gen]
        self.put_hdr: list[bytes] = []
        self.ack_hdr: list[bytes] = []
        self.get_hdr: list[bytes] = []
        self.exist_hdr: list[bytes] = []

    def _req(self, cmd: int, key: str, length: int = 0, size: int = 0) -> bytes:
        meta = ObjectMeta(MemoryFormat.BINARY, DType.UINT8, (size, 0, 0, 0), Location.LOCAL_CPU)
        return encode_request(cmd, key, length, generation=self.gen, meta=meta)

    def prepare(self, keys: Sequence[str], size: int) -> None:
        self.put_hdr = [self._req(Command.PUT, k, size, size) for k in keys]
        self.ack_hdr = [self._req(Command.PUT_ACK, k, size, size) for k in keys]
        self.get_hdr = [self._req(self._get_cmd(), k, self._get_length(size)) for k in keys]
        self.exist_hdr = [self._req(Command.EXIST, k) for k in keys]

    def _get_cmd(self) -> int:
        return int(Command.GET)

    def _get_length(self, size: int) -> int:
        return 0

    def _status(self) -> tuple[int, int]:
        rep = decode_reply(self.reader.read(self.reply_size), self.gen)
        return rep.status, rep.length

    def put(self, idxs: Sequence[int], body: memoryview) -> int:
        if not self.spec.put_ack:
            # Upstream servers have no acknowledged PUT: each PUT is followed by an EXIST.
            ok = 0
            for i in idxs:
                _sendmsg_all(self.sock, [self.put_hdr[i], body])
                self.sock.sendall(self.exist_hdr[i])
                status, length = self._status()
                self._skip(length)
                ok += status == Status.SUCCESS
            return ok
        for i in idxs:
            _sendmsg_all(self.sock, [self.ack_hdr[i], body])
        ok = 0
        for _ in idxs:
            status, length = self._status()
            self._skip(length)
            ok += status == Status.SUCCESS
        return ok

    def put_pipelined(self, idxs: Sequence[int], body: memoryview) -> int:
        for i in idxs:
            _sendmsg_all(self.sock, [self.put_hdr[i], body])
        self.sock.sendall(self.exist_hdr[idxs[-1]])
        status, length = self._status()
        self._skip(length)
        return len(idxs) if status == Status.SUCCESS else 0

    def get(self, idxs: Sequence[int], dest: memoryview) -> tuple[int, int]:
        hdrs = self.get_hdr
        self.sock.sendall(b"".join(hdrs[i] for i in idxs) if len(idxs) > 1 else hdrs[idxs[0]])
        hits = nbytes = 0
        for _ in idxs:
            status, length = self._status()
            if length:
                self._read_body(length, dest)
            if status == Status.SUCCESS and length:
                hits += 1
                nbytes += length
        return hits, nbytes

    def exist(self, idxs: Sequence[int]) -> int:
        hdrs = self.exist_hdr
        self.sock.sendall(b"".join(hdrs[i] for i in idxs) if len(idxs) > 1 else hdrs[idxs[0]])
        if len(idxs) > 1 and sys.byteorder == "little":  # the frame's ints, read in place
            return self._fixed_replies(len(idxs), self.reply_size, self._exist_hits)
        hits = 0
        for _ in idxs:
            status, length = self._status()
            self._skip(length)
            hits += status == Status.SUCCESS
        return hits

    def _exist_hits(self, replies: memoryview, n: int) -> int:
        """Hits among n EXIST replies: status 200, and no reply may carry a body."""
        words, stride = replies.cast("i"), self.reply_size // 4
        if any(words[1::stride]):
            raise ConnectionError("an EXIST reply announced a body")
        return words[0::stride].tolist().count(Status.SUCCESS)


class RawDriver(LmDriver):
    """v0 frames against the raw limit server: GET announces the wanted size; it can also stream."""

    name = "raw"

    def _get_length(self, size: int) -> int:
        return 0  # the raw server reads the size from the key

    def stream_put(self, body: memoryview, hdr: bytes, deadline_ns: int, max_objects: int) -> int:
        """Send objects back to back until the deadline; one EXIST round trip at the end."""
        import time

        n = 0
        while n < max_objects and time.perf_counter_ns() < deadline_ns:
            _sendmsg_all(self.sock, [hdr, body])
            n += 1
        self.sock.sendall(self.exist_hdr[0])
        self._status()
        return n

    def stream_get(self, dest: memoryview, deadline_ns: int, max_objects: int) -> int:
        """Receive a continuous stream of objects; two requests kept outstanding."""
        import time

        size = len(dest)
        per_req = max(1, (16 << 20) // max(size, 1))
        req = encode_request(RAW_STREAM, str(per_req), size)
        self.sock.sendall(req)
        n = 0
        outstanding = per_req
        while True:
            more = n < max_objects and time.perf_counter_ns() < deadline_ns
            if more:
                self.sock.sendall(req)
                outstanding += per_req
            for _ in range(per_req):
                self.reader.readinto(dest)
            outstanding -= per_req
            n += per_req
            if not more:
                break
        while outstanding:
            for _ in range(per_req):
                self.reader.readinto(dest)
            outstanding -= per_req
        return n


class RespDriver(Driver):
    """Redis RESP2: ``SET``/``GET``/``EXISTS`` with bulk strings, written minimally."""

    name = "resp"

    def prepare(self, keys: Sequence[str], size: int) -> None:
        self.set_hdr = []
        self.get_req = []
        self.exist_req = []
        for k in keys:
            kb = k.encode()
            kpart = b"$%d\r\n%s\r\n" % (len(kb), kb)
            self.set_hdr.append(b"*3\r\n$3\r\nSET\r\n" + kpart + b"$%d\r\n" % size)
            self.get_req.append(b"*2\r\n$3\r\nGET\r\n" + kpart)
            self.exist_req.append(b"*2\r\n$6\r\nEXISTS\r\n" + kpart)

    def _simple(self) -> bool:
        line = self.reader.readline()
        if line[:1] == b"-":
            return False
        if line[:1] == b"$":  # unexpected bulk: skip it
            n = int(line[1:])
            if n >= 0:
                self._skip(n + 2)
            return False
        return line == b"+OK" or line == b":1"

    def put(self, idxs: Sequence[int], body: memoryview) -> int:
        for i in idxs:
            _sendmsg_all(self.sock, [self.set_hdr[i], body, b"\r\n"])
        return sum(self._simple() for _ in idxs)

    put_pipelined = put

    def get(self, idxs: Sequence[int], dest: memoryview) -> tuple[int, int]:
        reqs = self.get_req
        self.sock.sendall(b"".join(reqs[i] for i in idxs) if len(idxs) > 1 else reqs[idxs[0]])
        hits = nbytes = 0
        for _ in idxs:
            line = self.reader.readline()
            if line[:1] != b"$":
                continue
            n = int(line[1:])
            if n < 0:
                continue
            self._read_body(n, dest)
            self.reader.read(2)
            hits += 1
            nbytes += n
        return hits, nbytes

    def exist(self, idxs: Sequence[int]) -> int:
        reqs = self.exist_req
        self.sock.sendall(b"".join(reqs[i] for i in idxs) if len(idxs) > 1 else reqs[idxs[0]])
        if len(idxs) > 1:  # EXISTS of one key answers ":0\r\n" or ":1\r\n"
            return self._fixed_replies(len(idxs), 4, _exists_hits)
        return sum(self._simple() for _ in idxs)

    def ping(self) -> bool:
        self.sock.sendall(b"*1\r\n$4\r\nPING\r\n")
        return self.reader.readline() == b"+PONG"


def _exists_hits(replies: memoryview, n: int) -> int:
    """Hits among n Redis EXISTS replies of one key each, checked to be exactly that."""
    data = bytes(replies)
    ones = data[1::4].count(b"1")
    if data[0::4] != b":" * n or data[2::4] != b"\r" * n or ones + data[1::4].count(b"0") != n:
        raise ConnectionError("unexpected reply to a pipelined EXISTS")
    return ones


def make_driver(spec: TargetSpec) -> Driver:
    if spec.kind == "resp":
        return RespDriver(spec)
    if spec.kind == "raw":
        return RawDriver(spec)
    return LmDriver(spec)


class OneObject:
    """One object of ``size`` bytes stored on a server, then asked for again and again: the
    load of ``bench.instructions --servers`` and ``bench.cpuprofile``. ``name`` labels errors."""

    def __init__(self, spec: TargetSpec, name: str, size: int) -> None:
        self.name = name
        self.driver = make_driver(spec)
        self.driver.prepare([bench_key(1, size, 0)], size)
        self.dest = memoryview(bytearray(size))
        if self.driver.put([0], memoryview(bytes(size))) != 1:
            self.driver.close()
            raise SystemExit(f"{name}: the priming PUT was refused")

    def ask(self, command: str, idxs: list[int]) -> None:
        """One round trip: an EXIST or GET of the object per entry of ``idxs`` (all 0)."""
        hits = self.driver.exist(idxs) if command == "exist" else self.driver.get(idxs, self.dest)[0]
        if hits != len(idxs):
            raise SystemExit(f"{self.name}: {command} missed the stored key")

    def close(self) -> None:
        self.driver.close()


def probe_put_ack(host: str, port: int, generation: int) -> bool:
    """Does an lm server answer PUT_ACK (an lmserver extension)? Probed with an empty body."""
    try:
        sock = _connect(host, port, timeout=5.0)
    except OSError:
        return False
    try:
        gen = Generation(generation)
        sock.sendall(encode_request(Command.PUT_ACK, "lmbench@1@0@probe@half", 0, generation=gen))
        sock.settimeout(1.0)
        head = sock.recv(REPLY_SIZE[gen])
        return len(head) >= 4 and struct.unpack_from("<i", head)[0] in {int(s) for s in Status}
    except OSError:
        return False
    finally:
        sock.close()
