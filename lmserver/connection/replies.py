"""A connection's replies: queued in order, copied or pinned, written with flow control.

Strategy (uvicorn's ``FlowControl``, with zero-copy bodies):

* Replies are queued during a read callback and written together at its end. Small ones
  (bodiless answers, GET replies of objects up to ``SMALL_REPLY``, which the memory tier
  copies out under its shard lock through ``ReplyCopier``) are copied one behind the other
  into the connection's ``ReplyBuffer`` and leave with one ``send``: no allocation per reply.
  A larger object goes out as header and body, separate buffers, the body zero-copy from its
  entry, which stays pinned until the transport's buffer has drained: the write-buffer limits
  are (0, 0), so the loop reports every partial write with ``pause_writing`` and the full
  drain with ``resume_writing``. That is also the backpressure: while anything is unsent,
  the connection reads nothing.
* That reasoning needs a transport that keeps what it could not send *by reference*, as
  uvloop's does. The standard library's copies it into a bytearray: 100 clients sending a GET
  for a 32 MiB object and never reading grew RSS by 1.7 GiB. So on a copying transport a
  reply over ``WRITE_PIECE`` bytes is handed over a piece at a time, the next piece only when
  the last has gone (``pump``): at most one piece per connection is ever copied.
* A PUT_ACK waiting for its disk write does not stop the pipeline: its reply, and every reply
  after it, are held in order (``held``) until the write is known, so a client can keep many
  acknowledged PUTs in flight (up to ``MAX_ACKS_IN_FLIGHT``).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections import deque
from collections.abc import Callable
from typing import Any, Final, final

from lmproto import PLACEHOLDER_META, Generation, ObjectMeta, Status, encode_error_text, encode_reply

from .._framed import ReplyBuffer, send_nowait
from ..plain import PlainTransport
from ..storage.memory import Entry, Reader

WRITE_PIECE: Final = 128 * 1024
"""On a transport that copies unsent bytes (the standard library's), the most handed to it
at once: what a connection whose peer does not read can make the server copy."""

FLUSH_THRESHOLD: Final = 4 * 1024 * 1024
"""Reply bytes queued in one callback before they are written without waiting for its end."""

REPLY_BUFFER_FLUSH: Final = 128 * 1024
"""Bytes of small replies in the reply buffer before they are written without waiting for the
callback's end: a connection's buffer never holds more than this and one reply (it is freed
when the connection goes quiet, with the staging buffer)."""

SMALL_REPLY: Final = 16 * 1024
"""GET replies up to this size (the default of ``LMProtocol.small_reply``, which
bench/hotpath.py varies) are copied into the reply buffer and the object unpinned at once;
larger ones go out as header + the object's own buffer, pinned until sent. Measured with
``python -m bench.hotpath`` (the Python work and the kernel's send per GET, 2026-12-02): the
copy costs 0.73-0.80x the pinned path at 1-16 KiB, 0.93x at 64 KiB and 1.18x at 256 KiB.
Past 16 KiB the gain is small, and every connection's reply buffer would have to hold more."""

MAX_ACKS_IN_FLIGHT: Final = 1024
"""PUT_ACKs of one connection that may wait for the disk at once before it stops reading."""

_EMPTY_REPLY_BUFFER: Final = ReplyBuffer().__sizeof__()  # the object alone, no capacity
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only
# Not compiled by mypyc (a C twin): Final, so not looked up in the module dict per call.
_send_nowait: Final = send_nowait
_SUCCESS: Final = int(Status.SUCCESS)
_FAIL: Final = int(Status.FAIL)


def _canned_replies(generation: Generation) -> dict[int, bytes]:
    # Plain int keys: looked up with a plain int, an IntEnum key costs a rich compare per hit.
    return {
        int(status): encode_reply(status, 0, generation=generation, meta=PLACEHOLDER_META)
        for status in Status
    }


CANNED: Final = {gen: _canned_replies(gen) for gen in Generation}
"""Bodiless replies by generation and status, encoded once."""


def _reply_header(entry: Entry, generation: Generation) -> bytes:
    """The GET reply header of ``entry`` for ``generation`` (cached on the entry by
    ``header_for``: its status, length and metadata never change once stored)."""
    meta: ObjectMeta = entry.meta
    return encode_reply(Status.SUCCESS, entry.length, generation=generation, meta=meta)


# One function per generation, for ``header_for`` (which keeps it as the tag of an entry's
# cached header): a module function is a plain call, where a bound method was a generic
# attribute lookup that builds a method object per GET (~5% of a pipelined 4 KiB GET).
_V0: Final = Generation.V0
_V1: Final = Generation.V1


def _v0_reply_header(entry: Entry) -> bytes:
    return _reply_header(entry, _V0)


def _v1_reply_header(entry: Entry) -> bytes:
    return _reply_header(entry, _V1)


REPLY_HEADER_OF: Final = {Generation.V0: _v0_reply_header, Generation.V1: _v1_reply_header}


def header_for(entry: Entry, header_of: Callable[[Entry], bytes]) -> bytes:
    """``header_of(entry)``, kept in the entry's reader cache under ``header_of`` as its tag:
    a GET reply's header depends only on what never changes once an object is stored, so the
    connections of one frame generation (one ``header_of``) encode it once per object.
    Compiled, a direct call and a pointer comparison per GET."""
    if entry.reader_tag is not header_of:
        entry.reader_cache = header_of(entry)
        entry.reader_tag = header_of
    return entry.reader_cache


class ReplyCopier(Reader):
    """How a connection's GET copies a small object out of memory (under its shard lock):
    the reply header, then the bytes, into the connection's reply buffer in one C call."""

    def __init__(self, add_framed: Callable[[bytes, Any], object]) -> None:
        self.add_framed = add_framed
        self.header_of: Callable[[Entry], bytes] = _v1_reply_header  # the connection's generation

    def copy(self, entry: Entry) -> None:
        self.add_framed(header_for(entry, self.header_of), entry.buffer)


class Held:
    """Replies that must wait for an earlier PUT_ACK whose write is still in flight."""

    __slots__ = ("buffers", "pins", "ready", "started")

    def __init__(self, ready: bool, started: float = 0.0) -> None:
        self.ready = ready
        self.started = started  # when the PUT_ACK's header arrived (latency metrics)
        self.buffers: list[bytes | memoryview] = []
        self.pins: list[Entry] = []


def _not_connected(data: bytes | memoryview) -> None:
    raise RuntimeError("a reply written before connection_made")


def _closing() -> bool:
    return True


@final
class Replies:
    """One connection's reply queue and its flow control (see the module docstring)."""

    def __init__(self, release: Callable[[Entry], None]) -> None:
        self.release = release  # the store's: done with a pinned entry
        # Small replies, copied one behind the other (see emit_one); its methods bound once:
        # compiled, a method call on it looks the method up by name.
        self.buffer = ReplyBuffer()
        self.add: Callable[[bytes], None] = self.buffer.add
        self.add_framed: Callable[[bytes, Any], None] = self.buffer.add_framed
        self._send_buffer: Callable[[int], int] = self.buffer.send
        self.copier = ReplyCopier(self.add_framed)  # what a GET hands the store
        self.generation = Generation.V1  # set by use_generation
        self.canned: dict[int, bytes] = CANNED[Generation.V1]
        # EXIST's two answers as attributes: no dict lookup per EXIST.
        self.canned_hit = self.canned_miss = b""
        self.header_of: Callable[[Entry], bytes] = _v1_reply_header
        # Replies that are not copied (a pinned object's header and body), and the reply
        # buffer's content ahead of them (seal): written in this order.
        self.queued: list[bytes | memoryview] = []
        self.queued_bytes = 0
        self.pins: list[Entry] = []  # entries referenced by queued replies
        self.unsent_pins: list[Entry] = []  # entries referenced by bytes the transport holds
        # Replies not yet handed to a transport that copies what it cannot send (see pump).
        self.outbox: deque[bytes | memoryview] = deque()
        self.held: deque[Held] = deque()
        self.acks_in_flight = 0
        self.write_paused = False
        self.owe_ack = False  # a fire-and-forget PUT was read and no reply carried its ACK
        # The transport's, bound once (attach): compiled, transport.write(x) looks the method
        # up by name on every reply.
        self.transport: asyncio.Transport | None = None
        self.write: Callable[[bytes | memoryview], None] = _not_connected
        self.copying_transport = False
        self.sock: Any = None  # the transport's socket, for TCP_QUICKACK (see ack_now)
        # The socket's descriptor if replies may be sent on it directly (a plain socket;
        # only while the transport is not closing: see send), else -1.
        self.fd = -1
        # transport.is_closing, bound once: the fd is closed (and may be reused by the next
        # accepted connection) as soon as the transport closes, before connection_lost.
        self.is_closing: Callable[[], bool] = _closing
        # The same transport when it is the server's own (plain.py), typed: compiled, its
        # is_closing() is then a direct call, where the bound method above is a generic one
        # (~120 instructions per reply).
        self.plain: PlainTransport | None = None

    def attach(self, transport: asyncio.BaseTransport, sock: Any) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.sock = sock
        # Transports that keep a reference to what they cannot send yet (ours, uvloop's)
        # rather than copying it (the stdlib's TLS transport): see flush.
        plain = transport if isinstance(transport, PlainTransport) else None
        self.copying_transport = not (plain is not None or type(transport).__module__.startswith("uvloop"))
        self.write = transport.write  # type: ignore[attr-defined]
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self.fd = sock.fileno()
            self.is_closing = transport.is_closing
            self.plain = plain

    def use_generation(self, generation: Generation) -> None:
        self.generation = generation
        self.canned = CANNED[generation]
        self.canned_hit, self.canned_miss = self.canned[_SUCCESS], self.canned[_FAIL]
        self.header_of = self.copier.header_of = REPLY_HEADER_OF[generation]

    # -- queueing ---------------------------------------------------------------------------

    def emit_canned(self, status: int) -> None:
        """A reply with no body: one precomputed header (the common case, kept fast)."""
        self.emit_one(self.canned[status])

    def emit_one(self, reply: bytes) -> None:
        """Queue a small reply: a copy in the reply buffer, or behind held replies if any."""
        if self.held:
            self.emit(reply)
        else:
            self.add(reply)

    def reply(self, status: int, body: bytes | memoryview = b"") -> None:
        if body:
            header = encode_reply(status, len(body), generation=self.generation, meta=PLACEHOLDER_META)
            self.emit_one(header + body)  # small (control replies), and not on a hot path
        else:
            self.emit_canned(status)

    def reply_error(self, status: int, reason: str) -> None:
        """An extension command's refusal: the status and a text saying why."""
        self.reply(status, encode_error_text(reason))

    def emit(self, *buffers: bytes | memoryview, pin: Entry | None = None) -> None:
        """Queue one reply as it is (header and body as separate buffers), behind held ones
        if any."""
        if self.held:
            tail = self.held[-1]
            if not tail.ready:
                tail = Held(ready=True)
                self.held.append(tail)
            tail.buffers += buffers
            if pin is not None:
                tail.pins.append(pin)
            return
        self.seal()
        self.queued += buffers
        if pin is not None:
            self.pins.append(pin)
        for buffer in buffers:  # not sum(map(len, ...)): compiled, builtins are looked up per call
            self.queued_bytes += len(buffer)

    def object(self, entry: Entry, copied: bool, small_reply: int) -> None:
        """A GET hit: header with the stored metadata, then the object's bytes. ``copied``:
        the store has queued all of it in the reply buffer already (``ReplyCopier``: the entry
        is not pinned); else ``entry`` is pinned, and a small one is copied here and
        released."""
        if not copied and entry.length <= small_reply:
            self.add_framed(header_for(entry, self.header_of), entry.buffer)
            self.release(entry)
            copied = True
        if not copied:
            self.emit(header_for(entry, self.header_of), entry.view, pin=entry)
        elif self.held:
            # Behind a PUT_ACK not yet answered (the buffer held nothing before it, see
            # hold_ack): it waits with the held replies, as its own bytes.
            self.emit(self.buffer.take())

    def seal(self) -> None:
        """Move what the reply buffer holds to the end of ``queued``, as one bytes object,
        so that what is queued next goes after it."""
        if len(self.buffer):
            reply = self.buffer.take()
            self.queued.append(reply)
            self.queued_bytes += len(reply)

    def full(self) -> bool:
        """Whether enough is queued to write it before the callback ends."""
        return self.queued_bytes >= FLUSH_THRESHOLD or len(self.buffer) >= REPLY_BUFFER_FLUSH

    # -- PUT_ACKs in flight -------------------------------------------------------------------

    def hold_ack(self, started: float) -> Held:
        """A PUT_ACK whose answer waits for its write: it, and every reply after it, wait."""
        slot = Held(ready=False, started=started)
        self.seal()  # queued replies go before this answer, and so before what waits for it
        self.held.append(slot)
        self.acks_in_flight += 1
        return slot

    def ack_known(self, slot: Held, ok: bool, refused_by: str) -> None:
        """The held PUT_ACK's write is known: answer it, and release what waited only for it."""
        if ok:
            slot.buffers.append(self.canned[_SUCCESS])
        else:
            # The tier that must hold it first refused it (full, failing, or too large).
            reason = encode_error_text(f"stored in memory, not in tier {refused_by}")
            header = encode_reply(Status.NO_SPACE, len(reason), generation=self.generation)
            slot.buffers += (header, reason)
        slot.ready = True
        self.seal()
        while self.held and self.held[0].ready:
            released = self.held.popleft()
            self.queued += released.buffers
            self.pins += released.pins
            self.queued_bytes += sum(map(len, released.buffers))

    # -- writing ------------------------------------------------------------------------------

    def flush(self) -> None:
        """Write what is queued (on a copying transport, a piece at a time)."""
        if not self.queued and not self.outbox:
            # Only small replies (the common case): the reply buffer's bytes in one write.
            buffered = len(self.buffer)
            if buffered and not (self.copying_transport and buffered > WRITE_PIECE):
                self.owe_ack = False  # the reply carries it
                self._send_buffered(buffered)
                return
        self.seal()
        if not self.queued:
            return
        queued = self.queued
        reply_bytes = self.queued_bytes
        self.queued, self.queued_bytes = [], 0
        self.owe_ack = False  # the reply carries it
        transport = self.transport
        assert transport is not None
        if self.outbox or (self.copying_transport and reply_bytes > WRITE_PIECE):
            self.outbox += queued
            self.pump()
        elif len(queued) == 1:
            self.send(queued[0])
        else:
            transport.writelines(queued)
        if self.pins:
            if transport.get_write_buffer_size() == 0 and not self.outbox:
                self.unpin(self.pins)
            else:
                self.unsent_pins += self.pins
            self.pins = []

    def _send_buffered(self, buffered: int) -> None:
        """Write the reply buffer's ``buffered`` bytes, as ``send`` would: what the socket does
        not take goes to the transport as a bytes copy, so the buffer is free again at once."""
        if self.may_send_directly() and self._send_buffer(self.fd) == 0:
            return
        self.write(self.buffer.take())

    def send(self, data: bytes | memoryview) -> None:
        """Write ``data`` after everything written before it: straight to the socket while the
        transport holds nothing unsent (``write_paused`` is False exactly then: its high-water
        mark is 0) and is not closing, and what the socket does not take (or everything, on an
        error) through the transport, which queues it and pauses writing until it is sent.

        Not once the transport is closing: it closes the descriptor at once (uvloop, on an
        error or our own close), and the next accepted connection may get the same number
        before connection_lost reaches us; a reply completed meanwhile (a lower-tier fetch)
        would go to that other client."""
        if self.may_send_directly():
            sent = _send_nowait(self.fd, data)
            if sent == len(data):
                return
            if sent:
                data = memoryview(data)[sent:]
        self.write(data)

    def may_send_directly(self) -> bool:
        if self.fd < 0 or self.write_paused:
            return False
        plain = self.plain
        return not (plain.is_closing() if plain is not None else self.is_closing())

    def ack_now(self) -> None:
        """Acknowledge what the peer sent now rather than after the delayed-ACK timer.

        A fire-and-forget PUT gets no reply to carry the ACK. A client with Nagle's algorithm
        on (upstream's v0 client sends header and body as two writes, without TCP_NODELAY)
        holds its next small write until that ACK, which delayed ACK postpones by up to
        40 ms: 24 PUT+GET pairs per second instead of thousands. TCP_QUICKACK sends the
        pending ACK at once (one setsockopt per read that ended with such a PUT)."""
        self.owe_ack = False
        if self.sock is not None and _TCP_QUICKACK is not None:
            with contextlib.suppress(OSError):
                self.sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)

    def pump(self) -> None:
        """Hand the outbox to the transport a piece at a time, while it sends everything it
        is given (with write-buffer limits (0, 0) a piece it cannot finish pauses writing)."""
        outbox, transport = self.outbox, self.transport
        assert transport is not None
        while outbox and not self.write_paused and not transport.is_closing():
            head = outbox[0]
            if len(head) > WRITE_PIECE:
                view = memoryview(head)
                outbox[0] = view[WRITE_PIECE:]
                transport.write(view[:WRITE_PIECE])
            else:
                outbox.popleft()
                transport.write(head)

    def drained(self) -> bool:
        """The transport sent everything (``resume_writing``): pump the rest of the outbox;
        True once every reply is out and its pins released."""
        self.write_paused = False
        if self.outbox:
            self.pump()
            if self.outbox or self.write_paused:
                return False  # the rest of the replies still references the pinned objects
        self.unpin(self.unsent_pins)
        self.unsent_pins = []
        return True

    # -- pins --------------------------------------------------------------------------------

    def unpin(self, entries: list[Entry]) -> None:
        release = self.release
        for entry in entries:
            release(entry)

    def release_all(self) -> None:
        """The connection is gone: let go of every entry a reply still referenced."""
        self.unpin(self.pins)
        self.unpin(self.unsent_pins)
        for slot in self.held:
            self.unpin(slot.pins)
        self.pins, self.unsent_pins = [], []
        self.held.clear()
        self.outbox.clear()
        self.buffer.release()

    @property
    def holding(self) -> int:
        """Bytes of reply buffer capacity this connection holds now."""
        return self.buffer.__sizeof__() - _EMPTY_REPLY_BUFFER
