"""One client connection: a BufferedProtocol state machine, header -> body -> dispatch.

Strategy:

* Headers (and the first bytes of bodies) are received into a per-connection staging
  buffer and parsed many per read, so a burst of pipelined small requests costs one
  wakeup and one reply write.
* The rest of a PUT body is received straight into the memory entry it will be stored in
  (``get_buffer`` returns a view of it): no copy after the kernel. A body the server
  refuses is read into the staging buffer and dropped, so the stream stays framed and
  nothing is allocated for it.
* Requests are answered strictly in order. Memory operations are answered inline; an
  operation that must wait (a lower-tier read, a DELETE, a PUT waiting for memory) pauses
  reading until it is done, then parsing resumes where it stopped. A PUT_ACK waiting for
  its disk write does not stop the pipeline (the object is already visible): its reply,
  and every reply after it, are held in order until the write is known, so a client can
  keep many acknowledged PUTs in flight (up to MAX_ACKS_IN_FLIGHT).
* Replies are queued during a read callback and written together at its end. Small ones
  (bodiless answers, GET replies of objects up to ``small_reply``, which the memory tier
  copies out under its shard lock) are copied one behind the other into the connection's
  ``ReplyBuffer`` and leave with one ``send``: no allocation per reply. A larger object goes
  out as header and body, separate buffers, the body zero-copy from its entry, which stays
  pinned until the
  transport's buffer has drained: the write-buffer limits are (0, 0), so the loop reports
  every partial write with ``pause_writing`` and the full drain with ``resume_writing``.
  That is also the backpressure: while anything is unsent, the connection reads nothing.
  That reasoning needs a transport that keeps what it could not send *by reference*, as
  uvloop's does. The standard library's copies it into a bytearray: 100 clients sending a
  GET for a 32 MiB object and never reading grew RSS by 1.7 GiB. So on a copying transport
  a reply over ``WRITE_PIECE`` bytes is handed over a piece at a time, the next piece only
  when the last has gone (``_pump``): at most one piece per connection is ever copied.
* A PUT's memory is charged as its body arrives, not when its header announces it: a fresh
  buffer (an untouched anonymous mmap, see pool.py) is charged for what is already staged
  plus one staging size, and ``get_buffer`` lets the socket fill only the charged part.
  Each time it is full the charge doubles (evicting LRU objects as needed, or waiting up to
  ``--memory-wait`` for pinned memory, then refusing the rest of the body). A header that
  announces 1 GiB and sends nothing holds 64 KiB, so it can neither flush the cache nor
  block other PUTs; a body that stops for ``--body-timeout`` is cut off. A reused buffer is
  already resident and counted, so it is charged in full at once (the fast path).
* Staging buffers come from a shared free list; a connection that received nothing since
  the last sweep gives its buffer back, so an idle connection holds none (a few KiB of
  Python objects, not 64 KiB).
* Timeouts are checked by a periodic sweep (``sweep``, run by the server), never per
  request: the read path only counts bytes received and requests parsed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import socket
import sys
import termios
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Final

import structlog

from lmproto import (
    EXTENSION_COMMANDS,
    MAX_CONTROL_BODY,
    NO_META,
    PLACEHOLDER_META,
    REQUEST_SIZE,
    Command,
    Generation,
    MalformedBody,
    ObjectMeta,
    RemoteProtocolError,
    Request,
    Status,
    decode_key_list,
    decode_lookups_into,
    decode_page_request,
    decode_request,
    detect_generation,
    encode_error_text,
    encode_json,
    encode_key_lines,
    encode_presence,
    encode_reply,
)

from . import bulk
from ._framed import ReplyBuffer, send_nowait
from .logs import ThrottledWarnings
from .plain import PlainTransport
from .state import ServerState
from .stats import server_stats
from .storage.memory import Entry, Reader
from .tls import write_buffer_high_water

log = structlog.get_logger("lmserver.connection")
throttled = ThrottledWarnings(log)

STAGING_SIZE: Final = 64 * 1024
"""Header staging buffer: holds ~400 pipelined requests; at most this much of a body is copied."""

STAGING_KEPT: Final = 64
"""Idle staging buffers kept on the shared free list (4 MiB); more are freed."""

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

LINGER_S: Final = 2.0
"""How long a gracefully closed connection keeps reading (and dropping) what the peer sends."""

MAX_ACKS_IN_FLIGHT: Final = 1024
"""PUT_ACKs of one connection that may wait for the disk at once before it stops reading."""

_EMPTY: Final = memoryview(b"")
_EMPTY_REPLY_BUFFER: Final = ReplyBuffer().__sizeof__()  # the object alone, no capacity
_LIST_BATCH: Final = 1024  # keys encoded at once into a LIST reply
_NO_STAGING: Final = bytearray()  # what a connection holds while it has no staging buffer
_free_staging: list[mmap.mmap] = []  # shared by every connection (list ops are atomic)
_TCP_QUICKACK: int | None = getattr(socket, "TCP_QUICKACK", None)  # Linux only
# Plain ints: cheaper dict keys and comparisons on the hot path.
_SUCCESS: Final = int(Status.SUCCESS)
_FAIL: Final = int(Status.FAIL)
# Not compiled by mypyc (a C twin): Final, so not looked up in the module dict per call.
_decode_lookups_into: Final = decode_lookups_into
_send_nowait: Final = send_nowait
_EXIST: Final = int(Command.EXIST)
_GET: Final = int(Command.GET)


def _unread_input(transport: asyncio.BaseTransport) -> bool:
    """Whether the kernel holds bytes from the peer that nobody has read (FIONREAD)."""
    sock = transport.get_extra_info("socket")
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return True  # unknown: assume there is, and linger
    return int.from_bytes(raw, sys.byteorder) > 0


class _Held:
    """Replies that must wait for an earlier PUT_ACK whose write is still in flight."""

    __slots__ = ("buffers", "pins", "ready", "started")

    def __init__(self, ready: bool, started: float = 0.0) -> None:
        self.ready = ready
        self.started = started  # when the PUT_ACK's header arrived (latency metrics)
        self.buffers: list[bytes | memoryview] = []
        self.pins: list[Entry] = []


def _canned_replies(generation: Generation) -> dict[int, bytes]:
    # Plain int keys: looked up with a plain int, an IntEnum key costs a rich compare per hit.
    return {
        int(status): encode_reply(status, 0, generation=generation, meta=PLACEHOLDER_META)
        for status in Status
    }


_CANNED: Final = {gen: _canned_replies(gen) for gen in Generation}


def _reply_header(entry: Entry, generation: Generation) -> bytes:
    """The GET reply header of ``entry`` for ``generation`` (cached on the entry by
    ``header_for``: its status, length and metadata never change once stored)."""
    meta: ObjectMeta = entry.meta
    return encode_reply(Status.SUCCESS, entry.length, generation=generation, meta=meta)


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


# One function per generation, for ``header_for`` (which keeps it as the tag of an entry's
# cached header): a module function is a plain call, where a bound method
# (self._reply_header) was a generic attribute lookup that builds a method object per GET
# (~5% of a pipelined 4 KiB GET).
_V0: Final = Generation.V0
_V1: Final = Generation.V1


def _v0_reply_header(entry: Entry) -> bytes:
    return _reply_header(entry, _V0)


def _v1_reply_header(entry: Entry) -> bytes:
    return _reply_header(entry, _V1)


_REPLY_HEADER_OF: Final = {Generation.V0: _v0_reply_header, Generation.V1: _v1_reply_header}


def _not_connected(data: bytes | memoryview) -> None:
    raise RuntimeError("a reply written before connection_made")


def _closing() -> bool:
    return True


class LMProtocol(asyncio.BufferedProtocol):
    def __init__(self, state: ServerState, address: str | None = None) -> None:
        # Shared server state
        self.state = state
        self.store = state.store
        self.config = state.config
        self.counters = state.counters
        self.small_reply = SMALL_REPLY

        # Per-connection state
        self.transport: asyncio.Transport | None = None
        # transport.write, bound once: compiled, transport.write(x) looks the method up by
        # name on every reply.
        self.write: Callable[[bytes | memoryview], None] = _not_connected
        self.peer: Any = None
        self.generation: Generation | None = {"v0": Generation.V0, "v1": Generation.V1}.get(
            self.config.protocol
        )
        # Bodiless replies of this connection's generation, encoded once; EXIST's two answers
        # also as attributes (no dict lookup per pipelined EXIST). Set by _use_generation.
        self._canned: dict[int, bytes] = {}
        self._canned_hit = self._canned_miss = b""
        # (miss, hit), as ReplyBuffer.add_exists takes them. Typed as a variable-length tuple:
        # compiled, a tuple[bytes, bytes] is kept unboxed, and boxed anew for every call.
        self._canned_exist: tuple[bytes, ...] = (b"", b"")
        self._reply_header: Callable[[Entry], bytes] = _v1_reply_header  # set by _use_generation
        self._request_size = 0  # set by _use_generation
        self.staging: bytearray | mmap.mmap = _NO_STAGING  # taken from the free list when needed
        self.staging_view = _EMPTY
        self.start = 0  # staged bytes not yet parsed are staging[start:end]
        self.end = 0
        # Small replies, copied one behind the other (see _emit_one); its methods bound once:
        # compiled, a method call on it looks the method up by name.
        self.reply_buffer = ReplyBuffer()
        self._add_reply: Callable[[bytes], None] = self.reply_buffer.add
        self._copy_reply: Callable[[bytes, Any], None] = self.reply_buffer.add_framed
        self._copier = ReplyCopier(self._copy_reply)  # what a GET hands the store
        if self.generation is not None:
            self._use_generation(self.generation)
        self._add_exists: Callable[..., tuple[int, int]] = self.reply_buffer.add_exists
        # What add_exists looks keys up in: the memory tier's dicts. With tiers behind memory,
        # a key memory lacks may be in one of them, so a run stops at it (Store.contains).
        self._exist_dicts: tuple[dict[str, Any], ...] = self.store.exist_index()
        self._exist_stops_at_miss = bool(self.store.links)
        self._send_replies: Callable[[int], int] = self.reply_buffer.send
        # Replies that are not copied (a pinned object's header and body), and the reply
        # buffer's content ahead of them (_seal_replies): written in this order.
        self.replies: list[bytes | memoryview] = []
        self.reply_bytes = 0
        self.reply_pins: list[Entry] = []  # entries referenced by queued replies
        self.unsent_pins: list[Entry] = []  # entries referenced by bytes the transport holds
        # Replies not yet handed to a transport that copies what it cannot send (see _pump).
        self.outbox: deque[bytes | memoryview] = deque()
        self.copying_transport = False
        # PUT_ACKs waiting for the disk do not stop the pipeline: their replies, and every
        # reply after them, are held here in order until the acknowledgement is known.
        self.held: deque[_Held] = deque()
        self.acks_in_flight = 0
        self.write_paused = False
        self.reading_paused = False  # what we last asked of the transport
        self.busy = False  # an awaited operation is in flight; parsing waits for it
        self.closing = False  # finish the current request, then close
        self.closed = False
        # The peer address whose slot (admission.py) this connection holds, given back on close.
        self.address = address
        # A TLS connection's handshake (admission.PendingHandshake), whose slot it takes over.
        self.handshake: Any = None
        self.sock: Any = None  # the transport's socket, for TCP_QUICKACK (see _ack_now)
        # The socket's descriptor if replies may be sent on it directly (a plain socket;
        # only while the transport is not closing: see _send), else -1.
        self.fd = -1
        # transport.is_closing, bound once: the fd is closed (and may be reused by the next
        # accepted connection) as soon as the transport closes, before connection_lost.
        self.is_closing: Callable[[], bool] = _closing
        # The same transport when it is the server's own (plain.py), typed: compiled, its
        # is_closing() is then a direct call, where the bound method above is a generic one
        # (~120 instructions per reply).
        self.plain: PlainTransport | None = None
        self.owe_ack = False  # a fire-and-forget PUT was read and no reply carried its ACK
        # Progress, for the timeout sweep: counted on the read path, compared by ``sweep``.
        self.received = 0
        self.parsed = 0
        self._seen_received = 0  # quiet since connection_made until bytes arrive
        self._quiet_since = 0.0
        self._header_since: float | None = None
        self._seen_parsed = 0
        self._seen_unsent = -1
        self._send_since = 0.0
        # Requests by command number (plus EXIST hits in slot 0), plain ints for metrics:
        # cheaper on the hot path than string-keyed counters; folded into the state on close.
        self.by_command = [0] * COMMAND_SLOTS
        # Counts of the hot path not yet in the string-keyed counters, which add_counts
        # adds them to when the counters are read (ServerState.current_counters) and on close:
        # a counter update per request or read was ~6% of a pipelined 4 KiB GET, and per
        # sequential request a sixth of this module's work.
        self.requests_uncounted = 0
        self.bytes_received_uncounted = 0
        self.exist_hits_uncounted = 0
        # The run of requests of one command that _serve_staged is counting (a pipelined
        # burst, or sequential requests, are mostly one run), added to by_command when
        # another command comes or by add_counts.
        self.run_command = EXIST_HITS_SLOT
        self.run_count = 0
        # The keys of the run of lookups being served, refilled by each decode_lookups_into
        # call (one list for the connection's life: no tuple made and freed per lookup).
        # _serve_staged is not re-entered while it iterates them: what it calls schedules
        # the connection's other callbacks, it does not run them.
        self.lookup_keys: list[str] = []
        self.gets_uncounted = 0
        self.get_bytes_uncounted = 0
        self.timed_since = 0.0  # when the request now waited on began (latency metrics)

        # Per-request state: where the current body goes and what happens when it is in
        self.body: memoryview | None = None
        self.body_pos = 0
        self.body_limit = 0  # the socket may fill body[body_pos:body_limit] (charged memory)
        self.body_request: Request | None = None  # the PUT being received, if any
        self.body_done: Callable[[], None] | None = None
        self.body_entry: Entry | None = None  # a PUT's reservation, aborted if cut short
        self.discard_left = 0

        # Commands without an object body; decode_request has already flagged unknown ones.
        # Filled by connection_made: bound methods of self make a reference cycle, which a
        # protocol that never connects (a failed TLS handshake) must not carry.
        self._handlers: dict[int, Callable[[Request, memoryview], None]] = {}

    # -- connection lifecycle -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Admitted when accepted (admission.py): --allow and the limits were applied then.
        if self.handshake is not None:
            self.handshake.hand_over(self)
            self.handshake = None
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.peer = transport.get_extra_info("peername")
        if self.state.shutting_down:  # a TLS handshake that finished during the shutdown
            self.closed = True
            self.transport.abort()  # type: ignore[union-attr]
            return
        self._handlers = {
            Command.GET: self._get,
            Command.EXIST: self._exist,
            Command.LIST: self._list,
            Command.HEALTH: self._health,
            Command.DELETE: self._delete,
            Command.EXIST_MANY: self._exist_many,
            Command.STATS: self._stats,
            Command.DELETE_MANY: self._delete_many,
            Command.LIST_PAGE: self._list_page,
        }
        self._quiet_since = asyncio.get_running_loop().time()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock = sock
        high = write_buffer_high_water(transport)  # 0, or 1 on TLS: see tls.py
        self.transport.set_write_buffer_limits(high=high, low=0)  # type: ignore[union-attr]
        # Transports that keep a reference to what they cannot send yet (ours, uvloop's) rather
        # than copying it (the stdlib's TLS transport): see _flush.
        plain = transport if isinstance(transport, PlainTransport) else None
        self.copying_transport = not (plain is not None or type(transport).__module__.startswith("uvloop"))
        self.write = self.transport.write  # type: ignore[union-attr]
        if sock is not None and transport.get_extra_info("ssl_object") is None:
            self.fd = sock.fileno()
            self.is_closing = transport.is_closing
            self.plain = plain
        self.state.connections.add(self)
        self.state.no_connections.clear()
        self.counters["connections_accepted"] += 1
        log.debug("connection open", peer=self.peer, connections=len(self.state.connections))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.state.connections:
            self.state.connections.discard(self)
            self.add_counts()
            self.state.fold_command_counts(self.by_command)
        if not self.state.connections:
            self.state.no_connections.set()
        self.state.release_address(self.address)
        self.address = None
        if self.body_entry is not None:
            # A body cut short (a PUT's, or a control body's): its reservation is given
            # back and, for a PUT, never published.
            self.counters["bodies_cut_short"] += 1
            self.store.abort(self.body_entry)
            self.body_entry = None
        self._release_pins()
        self.reply_buffer.release()
        self.body = self.body_request = None
        self.start = self.end = 0
        self._give_staging()
        log.debug("connection closed", peer=self.peer, error=repr(exc) if exc else None)

    def eof_received(self) -> bool:
        if self.body is not None or self.discard_left or self.end > self.start:
            log.debug("peer closed mid-request", peer=self.peer, unparsed=self.end - self.start)
        return False  # close our side too

    def shutdown(self) -> None:
        """Graceful stop: serve the requests already received (finishing a body in
        progress), read nothing new, then close."""
        if not self.closing:
            self.closing = True
            self._process()

    def _close_if_idle(self) -> None:
        if (
            self.closing
            and not self.closed
            and not self.busy
            and self.body is None
            and not self.discard_left
            and not self.held  # PUT_ACK answers still to come
            and not self.write_paused
        ):
            self._linger_close()

    def _linger_close(self) -> None:
        """Close without losing replies: send FIN after the last reply and drop whatever
        the peer still sends until it closes too (or LINGER_S passes). Closing outright
        with unread bytes in the socket makes the kernel send RST, which can discard
        replies the peer has not read yet."""
        self.closed = True
        transport = self.transport
        assert transport is not None
        if not _unread_input(transport) or not transport.can_write_eof():
            transport.close()  # nothing unread: a plain close sends FIN, not RST
            return
        transport.write_eof()
        self.start = self.end = 0
        transport.resume_reading()  # buffer_updated drops everything once closed
        self.reading_paused = False
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def _fatal(self, reason: str) -> None:
        """The stream can no longer be framed: log, count, and close this connection only."""
        self.counters["protocol_errors"] += 1
        throttled.warning("protocol error, closing connection", peer=self.peer, reason=reason)
        self._flush()
        self.closed = True
        assert self.transport is not None
        self.transport.close()

    # -- timeouts (checked by the periodic sweep) ------------------------------------------

    def tick(self, now: float, close_idle: bool) -> None:
        """One sweep: give back an unused staging buffer, and close the connection if it is
        past a timeout (docs/operating.md "Limits and timeouts"). ``close_idle``: the server is short
        of connections, so idle ones past ``--idle-timeout`` make room."""
        if self.closed:
            return
        config = self.config
        if self.received != self._seen_received:
            self._seen_received, self._quiet_since = self.received, now
        elif self.end == 0 and self.staging:
            self._give_staging()  # nothing staged and nothing received since the last sweep
            if not len(self.reply_buffer):  # every turn ends with a flush: empty but for a wait
                self.reply_buffer.release()
        quiet = now - self._quiet_since
        if self.write_paused:  # replies the peer does not read: they must drain steadily
            assert self.transport is not None
            unsent = self.transport.get_write_buffer_size()
            if unsent != self._seen_unsent:
                self._seen_unsent, self._send_since = unsent, now
            elif config.body_timeout and now - self._send_since >= config.body_timeout:
                self._time_out("send_timeouts", "replies not read")
            return
        self._seen_unsent = -1
        if self.busy or self.held:
            return  # waiting for the server itself, not for the peer
        if self.body is not None or self.discard_left:
            if config.body_timeout and quiet >= config.body_timeout:
                self._time_out("body_timeouts", "request body stalled")
        elif self.end > self.start:  # a header has started and not completed
            if self._header_since is None or self.parsed != self._seen_parsed:
                self._header_since, self._seen_parsed = now, self.parsed
            elif config.header_timeout and now - self._header_since >= config.header_timeout:
                self._time_out("header_timeouts", "request header incomplete")
            return
        elif close_idle and config.idle_timeout and quiet >= config.idle_timeout and not self.acks_in_flight:
            self.counters["idle_closed"] += 1
            log.debug("closing idle connection", peer=self.peer, idle_s=round(quiet, 1))
            self._linger_close()
        self._header_since = None

    def idle_since(self, now: float) -> float | None:
        """Since when (loop time) this connection has waited for its peer with nothing in
        progress: ``now`` if bytes came since the last sweep; None while a request is in
        progress (a body, a partial header, an operation, replies unsent or held)."""
        if (
            self.closed
            or self.busy
            or self.held
            or self.acks_in_flight
            or self.write_paused
            or self.body is not None
            or self.discard_left
            or self.end > self.start
        ):
            return None
        return self._quiet_since if self.received == self._seen_received else now

    def displace(self) -> None:
        """Make room for a newcomer at --max-connections (admission.py): this connection is
        idle, so nothing in progress is lost; closed at once, its slot free on the next turn."""
        log.debug("idle connection displaced by a newcomer", peer=self.peer)
        self.closed = True
        assert self.transport is not None
        self.transport.abort()

    def _time_out(self, counter: str, reason: str) -> None:
        """The peer stopped making progress: drop the connection (and what it reserved)."""
        self.counters[counter] += 1
        throttled.warning("connection timed out", peer=self.peer, reason=reason)
        self.closed = True
        assert self.transport is not None
        self.transport.abort()  # close() would wait for unsent replies the peer never reads

    # -- reading --------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.body is not None:
            return self.body[self.body_pos : self.body_limit]
        if self.staging is _NO_STAGING:  # not `not self.staging`: a generic truth test per read
            self._take_staging()
        if self.discard_left or not self.end:
            # Empty staging (always so while a body is dropped; usually so between
            # sequential requests): the whole view as it is, no slice to build per read.
            return self.staging_view
        if self.start and self.end + 512 > STAGING_SIZE:
            # Move a partial header to the front so a whole one always fits.
            pending = self.end - self.start
            self.staging[:pending] = self.staging_view[self.start : self.end]
            self.start, self.end = 0, pending
        return self.staging_view[self.end :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closed:
            self.start = self.end = 0  # closing: what still arrives is dropped
            return
        self.bytes_received_uncounted += nbytes
        self.received += nbytes
        if self.body is not None:
            self.body_pos += nbytes
            if self.body_pos == self.body_limit:
                if self.body_pos == len(self.body):
                    self._body_complete()
                else:
                    self._grow_body()
        elif self.discard_left:
            dropped = min(nbytes, self.discard_left)
            self.discard_left -= dropped
            self.start, self.end = dropped, nbytes
            if not self.end > self.start:
                self.start = self.end = 0
        else:
            self.end += nbytes
        self._process()

    def _process(self) -> None:
        """Parse and serve staged requests until data runs out or something must wait."""
        if self.generation is None:
            generation = detect_generation(self.staging_view[: self.end], self.start)
            if generation is not None:
                self._use_generation(generation)
        if self.generation is not None:
            self._serve_staged(self.generation)
        self._flush()
        if self.owe_ack:
            self._ack_now()
        self._close_if_idle()
        self._update_reading()

    def _serve_staged(self, generation: Generation) -> None:
        # The hot loop of pipelined small requests: keep its per-request work minimal.
        size = self._request_size
        staging = self.staging_view
        handlers = self._handlers
        by_command = self.by_command
        # Requests by command, counted as runs of one command (a pipelined burst is usually one
        # run): a local small-int add per request instead of a list update.
        last, run = self.run_command, self.run_count
        served = 0
        check = True  # whether the last request may have changed what _can_parse says
        while self.end - self.start >= size:
            if check and not self._can_parse():
                break
            if last == _EXIST and not self.held:
                # A connection that is looking keys up (LMCache: one EXIST per chunk, in
                # order) mostly goes on doing so: its run of EXISTs answered in one C call,
                # each key looked up and its reply queued with no object made for it but the
                # key's str. It stops where something else must decide (another command, a
                # key its scan does not take, a key memory lacks with tiers behind it).
                done, hits = self._add_exists(
                    staging,
                    generation,
                    self.start,
                    self.end,
                    self._exist_dicts,
                    self._canned_exist,
                    self._exist_stops_at_miss,
                )
                if done:
                    self.exist_hits_uncounted += hits
                    self.start += done * size
                    if self.start == self.end:
                        self.start = self.end = 0
                    served += done
                    run += done
                    check = False
                    if self._replies_full():
                        self._flush()
                        check = True
                    continue
            # EXIST and GET without a body and with a valid key, the bulk of a pipelined burst,
            # need only the command and key: one decode_lookups_into call takes a whole run of them
            # (no Request built). Every other header takes decode_request.
            keys = self.lookup_keys
            command = _decode_lookups_into(staging, generation, self.start, self.end, keys)
            if keys:
                if command == _EXIST:
                    # Answered inline, and nothing _can_parse reads changes: the run at once.
                    hits = 0
                    for key in keys:
                        hits += self._exist_key(key)
                    self.exist_hits_uncounted += hits
                    done = len(keys)
                    self.start += done * size
                    check = False
                else:
                    done = 0
                    for key in keys:  # one at a time: a GET may start a fetch or fill the socket
                        self.start += size
                        done += 1
                        self._get_key(key)
                        if self._replies_full():
                            self._flush()
                        if not self._can_parse():
                            break  # the rest of the run is decoded again when it can go on
                    check = True
                if self.start == self.end:
                    self.start = self.end = 0
                served += done
            else:
                try:
                    request = decode_request(staging, generation, self.start)
                except RemoteProtocolError as exc:
                    self._fatal(str(exc))
                    break
                self.start += size
                if self.start == self.end:
                    self.start = self.end = 0
                served += 1
                if request.length or request.problem is not None or command not in handlers:
                    self._on_header(request)  # counts the request itself
                    done = 0
                    check = True
                else:
                    handlers[command](request, _EMPTY)
                    done = 1
                    check = command not in _ANSWERED_INLINE
            if command == last:
                run += done
            elif done:
                if run:
                    by_command[last] += run
                last, run = command, done
            if self._replies_full():
                self._flush()
                check = True
        self.run_command, self.run_count = last, run
        self.requests_uncounted += served
        self.parsed += served

    def _can_parse(self) -> bool:
        return not (
            self.busy
            or self.write_paused
            or self.closed
            or self.body is not None
            or self.discard_left
            or self.acks_in_flight >= MAX_ACKS_IN_FLIGHT
        )

    # -- request headers ------------------------------------------------------------------

    def _on_header(self, req: Request) -> None:
        command = req.command
        if req.problem is None:
            self.by_command[command] += 1
        if req.problem is not None:
            self._refuse(req, Status.FAIL, req.problem, counter="bad_requests")
        elif command == Command.PUT or command == Command.PUT_ACK:
            self.owe_ack |= command == Command.PUT  # a PUT_ACK's reply comes later, maybe held
            self._time_start()
            self._begin_put(req)
        elif req.length > MAX_CONTROL_BODY:
            self._refuse(req, Status.TOO_LARGE, f"body of {req.length} bytes exceeds {MAX_CONTROL_BODY}")
        elif req.length:
            # Control bodies are small, but many connections could send one at once: take
            # them from the memory budget like objects, and give the buffer back after use.
            scratch = self.store.reserve(req.length)
            if scratch is None:
                self._refuse(
                    req, Status.NO_SPACE, "no memory for the request body", counter="refused_no_space"
                )
                return
            self.body_entry = scratch
            self._receive_body(scratch.view, lambda: self._dispatch_scratch(req, scratch))
        else:
            self._dispatch(req, _EMPTY)

    def _refuse(self, req: Request, status: Status, reason: str, *, counter: str = "refused") -> None:
        """Answer a request the server will not serve, and drop its body unread."""
        self.counters[counter] += 1
        if req.problem is None:
            # By command for metrics; not "refused_..." (STATS sums those as refusals once).
            self.counters[f"command_{int(req.command)}_refused"] += 1
        log.debug("request refused", peer=self.peer, command=req.command, reason=reason)
        if req.command == Command.PUT:
            pass  # fire-and-forget: upstream clients read no reply to a PUT
        elif req.command in EXTENSION_COMMANDS:
            body = encode_error_text(reason)
            self._reply(status, memoryview(body))
        else:
            self._reply(Status.FAIL)  # upstream commands: 400, length 0, nothing else
        self.discard_left = req.length
        self._drain_staged_discard()

    def _drain_staged_discard(self) -> None:
        staged = self.end - self.start
        dropped = min(staged, self.discard_left)
        self.discard_left -= dropped
        self.start += dropped
        if self.start == self.end:
            self.start = self.end = 0

    def _receive_body(self, target: memoryview, done: Callable[[], None]) -> None:
        """Fill ``target`` with the body: first from staging, then straight from the socket."""
        staged = min(self.end - self.start, len(target))
        if staged:
            target[:staged] = self.staging_view[self.start : self.start + staged]
            self.start += staged
            if self.start == self.end:
                self.start = self.end = 0
        if staged == len(target):
            done()
            return
        self.body, self.body_pos, self.body_limit, self.body_done = target, staged, len(target), done

    def _body_complete(self) -> None:
        done = self.body_done
        self.body = self.body_done = self.body_request = None
        assert done is not None
        done()

    def _grow_body(self) -> None:
        """The charged part of a PUT's buffer is full: charge more before reading on."""
        entry, body = self.body_entry, self.body
        assert entry is not None and body is not None
        want = min(len(body), max(2 * self.body_pos, self.body_pos + STAGING_SIZE))
        if want == len(body):
            want = len(entry.buffer)  # all of it: a fully charged buffer is reused later
        if self.store.grow(entry, want):
            self._body_grown(True)
        else:
            self._await(self.store.grow_wait(entry, want, self.config.memory_wait), self._body_grown)

    def _body_grown(self, ok: bool) -> None:
        entry, body, req = self.body_entry, self.body, self.body_request
        assert entry is not None and body is not None and req is not None
        if ok:
            self.body_limit = min(entry.charged, len(body))
            return
        # No memory for the rest of the body: give back what it holds, answer, drop the rest.
        self.body_entry = self.body = self.body_done = self.body_request = None
        self.store.abort(entry)
        remaining = len(body) - self.body_pos
        self._refuse(req, Status.NO_SPACE, "memory is full of objects in use", counter="refused_no_space")
        self.discard_left = remaining

    def _take_staging(self) -> None:
        try:
            self.staging = _free_staging.pop()
        except IndexError:
            # An mmap: its pages cost RSS only once touched (one, for a lone small request),
            # and a freed one goes back to the OS, not into malloc's heap.
            self.staging = mmap.mmap(-1, STAGING_SIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.staging_view = memoryview(self.staging)

    def _give_staging(self) -> None:
        """Return the staging buffer to the free list (only while nothing is staged)."""
        if self.staging and self.end == 0:
            if len(_free_staging) < STAGING_KEPT:
                _free_staging.append(self.staging)  # type: ignore[arg-type]  # never _NO_STAGING
            self.staging, self.staging_view = _NO_STAGING, _EMPTY

    # -- PUT ------------------------------------------------------------------------------

    def _begin_put(self, req: Request) -> None:
        if req.length > self.config.max_object_size:
            self._refuse(
                req,
                Status.TOO_LARGE,
                f"object of {req.length} bytes exceeds the limit of {self.config.max_object_size}",
                counter="refused_too_large",
            )
            return
        if not self.store.room_for(req.length):
            # A full=wait tier is behind: read this body (and what follows it on this
            # connection) only once it has caught up (Store.room_for).
            self.counters["put_waits_tier"] += 1
            self._await(
                self.store.wait_for_room(req.length, self.config.memory_wait),
                lambda room: self._reserve_put(req, room),
            )
            return
        self._reserve_put(req, True)

    def _reserve_put(self, req: Request, room: bool) -> None:
        # Charge only what is staged, plus room for one read (module docstring).
        first = self.end - self.start + STAGING_SIZE
        # A body that fits the first charge is charged whole: a fully charged buffer is reused.
        upfront = None if first >= req.length else first
        entry = self.store.reserve(req.length, upfront)
        if entry is None:
            self.counters["put_waits_memory"] += 1
            self._await(
                self.store.reserve_wait(req.length, self.config.memory_wait, upfront),
                lambda entry: self._receive_put(req, entry, room),
            )
            return
        self._receive_put(req, entry, room)

    def _receive_put(self, req: Request, entry: Entry | None, room: bool) -> None:
        if entry is None:
            self._time_end(req.command)
            self._refuse(req, Status.NO_SPACE, "memory is full of objects in use", counter="refused_no_space")
            return
        self.body_entry = entry
        self.body_request = req
        self._receive_body(memoryview(entry.buffer)[: req.length], lambda: self._finish_put(req, entry, room))
        if self.body is not None:
            self.body_limit = min(entry.charged, req.length)
            if self.body_pos == self.body_limit:
                self._grow_body()

    def _finish_put(self, req: Request, entry: Entry, room: bool) -> None:
        self.body_entry = self.body_request = None
        meta = req.meta if req.generation == Generation.V1 else NO_META
        persisted = self.store.commit(
            req.key, entry, meta, acknowledged=req.command == Command.PUT_ACK, room=room
        )
        self.counters["puts"] += 1
        self.counters["put_bytes"] += req.length
        if req.command != Command.PUT_ACK or persisted is None:
            self._time_end(req.command)
            if req.command == Command.PUT_ACK:
                self._reply(Status.SUCCESS)
            else:
                self.owe_ack = True
            return
        slot = _Held(ready=False, started=self.timed_since)
        self._seal_replies()  # queued replies go before this answer, and so before what waits for it
        self.held.append(slot)
        self.acks_in_flight += 1
        persisted.add_done_callback(lambda done: self._ack_persisted(slot, done.result()))

    def _ack_persisted(self, slot: _Held, ok: bool) -> None:
        self.acks_in_flight -= 1
        if self.closed:
            return
        self._time_end(Command.PUT_ACK, slot.started)  # others may be timed meanwhile
        assert self.generation is not None
        if ok:
            slot.buffers.append(self._canned[Status.SUCCESS])
        else:
            # The tier that must hold it first refused it (full, failing, or the object too large).
            reason = encode_error_text(f"stored in memory, not in tier {self.store.links[0].name}")
            header = encode_reply(Status.NO_SPACE, len(reason), generation=self.generation)
            slot.buffers += (header, reason)
        slot.ready = True
        self._seal_replies()
        while self.held and self.held[0].ready:
            released = self.held.popleft()
            self.replies += released.buffers
            self.reply_pins += released.pins
            self.reply_bytes += sum(map(len, released.buffers))
        self._process()

    @property
    def _acks_full(self) -> bool:
        return self.acks_in_flight >= MAX_ACKS_IN_FLIGHT

    # -- other commands -------------------------------------------------------------------

    def _dispatch_scratch(self, req: Request, scratch: Entry) -> None:
        self.body_entry = None
        try:
            self._dispatch(req, scratch.view)
        finally:
            self.store.abort(scratch)

    def _dispatch(self, req: Request, body: memoryview) -> None:
        self._handlers[req.command](req, body)

    def _get(self, req: Request, body: memoryview) -> None:
        self._get_key(req.key)

    def _get_key(self, key: str) -> None:
        entry = self.store.read(key, self.small_reply, self._copier)
        if entry is not None:
            self._reply_object(entry, copied=entry.length <= self.small_reply)
        elif self.store.in_lower(key):
            self._time_start()
            self._await(self.store.fetch(key), self._reply_fetched)
        else:
            self._reply_miss()

    def _exist(self, req: Request, body: memoryview) -> None:
        self.exist_hits_uncounted += self._exist_key(req.key)

    def _exist_key(self, key: str) -> int:
        """Answer an EXIST; 1 for a hit, 0 for a miss (the caller counts hits)."""
        if self.store.contains(key):
            self._emit_one(self._canned_hit)
            return 1
        self._emit_one(self._canned_miss)
        return 0

    def _list(self, req: Request, body: memoryview) -> None:
        # Encoded in batches, so no second whole copy of a long reply exists outside the
        # memory budget (see _reply_held).
        keys = self.store.keys(req.key, self.config.max_list_keys)
        if not keys:
            self._reply(Status.SUCCESS)
            return
        chunks = [encode_key_lines(keys[i : i + _LIST_BATCH]) for i in range(0, len(keys), _LIST_BATCH)]
        del keys
        if not self._reply_held(chunks, b"\n"):
            self._reply(Status.FAIL)  # an upstream command: 400, length 0

    def _list_page(self, req: Request, body: memoryview) -> None:
        try:
            limit, after = decode_page_request(body)
        except MalformedBody as exc:
            self._malformed(exc)
            return
        page = bulk.list_page(self.store, req.key, after, min(limit, self.config.max_list_keys))
        if not self._reply_held([page]):
            self._reply(Status.NO_SPACE, memoryview(encode_error_text("no memory for the reply")))

    def _reply_held(self, chunks: list[bytes], separator: bytes = b"") -> bool:
        """Reply 200 with ``chunks`` joined by ``separator`` as the body, held from the memory
        budget until sent, like an object being sent: a client that asks for listings and
        never reads cannot grow the server past --memory-limit. False if no memory."""
        entry = self.store.reserve(sum(map(len, chunks)) + len(separator) * (len(chunks) - 1))
        if entry is None:
            self.counters["refused_no_space"] += 1
            return False
        out, pos = memoryview(entry.buffer), 0
        for chunk in chunks:
            if pos and separator:
                out[pos : pos + len(separator)] = separator
                pos += len(separator)
            out[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        assert self.generation is not None
        header = encode_reply(Status.SUCCESS, entry.length, generation=self.generation, meta=PLACEHOLDER_META)
        self._emit(header, entry.view, pin=entry)
        return True

    def _health(self, req: Request, body: memoryview) -> None:
        self._emit_canned(Status.FAIL if self.state.shutting_down else Status.SUCCESS)

    def _delete(self, req: Request, body: memoryview) -> None:
        self._time_start()
        self._await(self.store.delete(req.key), self._reply_deleted)

    def _exist_many(self, req: Request, body: memoryview) -> None:
        try:
            keys = decode_key_list(body)
        except MalformedBody as exc:
            self._malformed(exc)
            return
        contains = self.store.contains
        self._reply(Status.SUCCESS, memoryview(encode_presence([contains(k) for k in keys])))

    def _delete_many(self, req: Request, body: memoryview) -> None:
        try:
            keys = decode_key_list(body)
        except MalformedBody as exc:
            self._malformed(exc)
            return
        self._time_start()
        self._await(bulk.delete_many(self.store, keys), self._reply_many_deleted)

    def _malformed(self, exc: MalformedBody) -> None:
        self.counters["bad_requests"] += 1
        self._reply(Status.FAIL, memoryview(encode_error_text(str(exc))))

    def _stats(self, req: Request, body: memoryview) -> None:
        self._reply(Status.SUCCESS, memoryview(encode_json(server_stats(self.state))))

    def _reply_fetched(self, entry: Entry | None) -> None:
        self._time_end(Command.GET)
        if entry is None:
            self._reply_miss()
        else:
            self._reply_object(entry)

    def _reply_miss(self) -> None:
        self.counters["gets_missed"] += 1
        self._reply(Status.FAIL)

    def _reply_deleted(self, found: bool) -> None:
        self._time_end(Command.DELETE)
        self._reply(Status.SUCCESS if found else Status.NOT_FOUND)

    def _reply_many_deleted(self, presence: bytes) -> None:
        self._time_end(Command.DELETE_MANY)
        self._reply(Status.SUCCESS, memoryview(presence))

    # -- latency of requests that are not answered inline (metrics) ----------------------

    def _time_start(self) -> None:
        if self.state.latency is not None:
            self.timed_since = time.perf_counter()

    def _time_end(self, command: int, started: float | None = None) -> None:
        latency = self.state.latency
        if latency is not None:
            since = self.timed_since if started is None else started
            latency.record(command, time.perf_counter() - since)

    # -- replies ------------------------------------------------------------------------

    def _reply(self, status: int, body: memoryview = _EMPTY) -> None:
        assert self.generation is not None
        if body:
            header = encode_reply(status, len(body), generation=self.generation, meta=PLACEHOLDER_META)
            self._emit_one(header + body)  # small (control replies), and not on a hot path
        else:
            self._emit_canned(status)

    def _reply_object(self, entry: Entry, *, copied: bool = False) -> None:
        """A GET hit: header with the stored metadata, then the object's bytes. ``copied``:
        the store has queued all of it in the reply buffer already (MemoryTier.read: the
        entry is not pinned); else ``entry`` is pinned, and a small one is copied here and
        unpinned."""
        if not copied and entry.length <= self.small_reply:
            self._copy_reply(header_for(entry, self._reply_header), entry.buffer)
            self.store.release(entry)
            copied = True
        if not copied:
            self._emit(header_for(entry, self._reply_header), entry.view, pin=entry)
        elif self.held:
            # Behind a PUT_ACK not yet answered (the buffer held nothing before it, see
            # _finish_put): it waits with the held replies, as its own bytes.
            self._emit(self.reply_buffer.take())
        self.gets_uncounted += 1
        self.get_bytes_uncounted += entry.length

    def _use_generation(self, generation: Generation) -> None:
        self.generation = generation
        self._canned = _CANNED[generation]
        self._canned_hit, self._canned_miss = self._canned[_SUCCESS], self._canned[_FAIL]
        self._canned_exist = (self._canned_miss, self._canned_hit)
        self._reply_header = self._copier.header_of = _REPLY_HEADER_OF[generation]
        # Kept as a plain int: REQUEST_SIZE[generation] hashes an IntEnum, which Enum does in
        # Python, once per read.
        self._request_size = REQUEST_SIZE[generation]

    def _emit_canned(self, status: int) -> None:
        """A reply with no body: one precomputed header (the common case, kept fast)."""
        self._emit_one(self._canned[status])

    def _emit_one(self, reply: bytes) -> None:
        """Queue a small reply: a copy in the reply buffer, or behind held replies if any."""
        if self.held:
            self._emit(reply)
        else:
            self._add_reply(reply)

    def _emit(self, *buffers: bytes | memoryview, pin: Entry | None = None) -> None:
        """Queue one reply as it is (header and body as separate buffers), behind held ones
        if any."""
        if self.held:
            tail = self.held[-1]
            if not tail.ready:
                tail = _Held(ready=True)
                self.held.append(tail)
            tail.buffers += buffers
            if pin is not None:
                tail.pins.append(pin)
            return
        self._seal_replies()
        self.replies += buffers
        if pin is not None:
            self.reply_pins.append(pin)
        for buffer in buffers:  # not sum(map(len, ...)): compiled, builtins are looked up per call
            self.reply_bytes += len(buffer)

    def _seal_replies(self) -> None:
        """Move what the reply buffer holds to the end of ``replies``, as one bytes object,
        so that what is queued next goes after it."""
        if len(self.reply_buffer):
            reply = self.reply_buffer.take()
            self.replies.append(reply)
            self.reply_bytes += len(reply)

    def _replies_full(self) -> bool:
        """Whether enough is queued to write it before the callback ends."""
        return self.reply_bytes >= FLUSH_THRESHOLD or len(self.reply_buffer) >= REPLY_BUFFER_FLUSH

    def _flush(self) -> None:
        if self.closed:
            return
        if not self.replies and not self.outbox:
            # Only small replies (the common case): the reply buffer's bytes in one write.
            buffered = len(self.reply_buffer)
            if buffered and not (self.copying_transport and buffered > WRITE_PIECE):
                self.owe_ack = False  # the reply carries it
                self._send_buffered(buffered)
                return
        self._seal_replies()
        if not self.replies:
            return
        replies, reply_bytes = self.replies, self.reply_bytes
        self.replies, self.reply_bytes = [], 0
        self.owe_ack = False  # the reply carries it
        transport = self.transport
        assert transport is not None
        if self.outbox or (self.copying_transport and reply_bytes > WRITE_PIECE):
            self.outbox += replies
            self._pump()
        elif len(replies) == 1:
            self._send(replies[0])
        else:
            transport.writelines(replies)
        if self.reply_pins:
            if transport.get_write_buffer_size() == 0 and not self.outbox:
                self._unpin(self.reply_pins)
            else:
                self.unsent_pins += self.reply_pins
            self.reply_pins = []

    def _send_buffered(self, buffered: int) -> None:
        """Write the reply buffer's ``buffered`` bytes, as ``_send`` would: what the socket does
        not take goes to the transport as a bytes copy, so the buffer is free again at once."""
        if self._may_send_directly() and self._send_replies(self.fd) == 0:
            return
        self.write(self.reply_buffer.take())

    def _send(self, data: bytes | memoryview) -> None:
        """Write ``data`` after everything written before it: straight to the socket while the
        transport holds nothing unsent (``write_paused`` is False exactly then: its high-water
        mark is 0) and is not closing, and what the socket does not take (or everything, on an
        error) through the transport, which queues it and pauses writing until it is sent.

        Not once the transport is closing: it closes the descriptor at once (uvloop, on an
        error or our own close), and the next accepted connection may get the same number
        before connection_lost reaches us; a reply completed meanwhile (a lower-tier fetch)
        would go to that other client."""
        if self._may_send_directly():
            sent = _send_nowait(self.fd, data)
            if sent == len(data):
                return
            if sent:
                data = memoryview(data)[sent:]
        self.write(data)

    def _may_send_directly(self) -> bool:
        if self.fd < 0 or self.write_paused:
            return False
        plain = self.plain
        return not (plain.is_closing() if plain is not None else self.is_closing())

    def buffer_bytes(self) -> int:
        """Memory this connection holds outside ``--memory-limit``: its staging buffer and its
        reply buffer's capacity (both given back when it goes quiet)."""
        staging = len(self.staging) if self.staging else 0
        return staging + self.reply_buffer.__sizeof__() - _EMPTY_REPLY_BUFFER

    def add_counts(self) -> None:
        """Add what this connection counted in plain ints to the server's counters and to
        its own by_command."""
        if self.run_count:
            self.by_command[self.run_command] += self.run_count
            self.run_count = 0
        if self.exist_hits_uncounted:
            self.by_command[EXIST_HITS_SLOT] += self.exist_hits_uncounted
            self.exist_hits_uncounted = 0
        counters = self.counters
        counters["requests"] += self.requests_uncounted
        counters["bytes_received"] += self.bytes_received_uncounted
        counters["gets_served"] += self.gets_uncounted
        counters["get_bytes"] += self.get_bytes_uncounted
        self.requests_uncounted = self.bytes_received_uncounted = 0
        self.gets_uncounted = self.get_bytes_uncounted = 0

    def _ack_now(self) -> None:
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

    def pause_writing(self) -> None:
        self.write_paused = True
        self._update_reading()

    def _pump(self) -> None:
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

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.outbox:
            self._pump()
            if self.outbox or self.write_paused:
                return  # the rest of the replies still references the pinned objects
        self._unpin(self.unsent_pins)
        self.unsent_pins = []
        self._process()

    def _unpin(self, entries: list[Entry]) -> None:
        unpin = self.store.release
        for entry in entries:
            unpin(entry)

    def _release_pins(self) -> None:
        self._unpin(self.reply_pins)
        self._unpin(self.unsent_pins)
        for slot in self.held:
            self._unpin(slot.pins)
        self.reply_pins, self.unsent_pins = [], []
        self.held.clear()
        self.outbox.clear()

    # -- waiting ------------------------------------------------------------------------

    def _await(self, awaitable: Awaitable[Any], then: Callable[[Any], None]) -> None:
        """Run ``awaitable``; parsing stops until ``then(result)`` has run."""
        self.busy = True
        self._flush()
        task = asyncio.ensure_future(awaitable)
        self.state.tasks.add(task)
        task.add_done_callback(lambda t: self._resume(t, then))

    def _resume(self, task: asyncio.Future[Any], then: Callable[[Any], None]) -> None:
        self.state.tasks.discard(task)
        self.busy = False
        if task.cancelled():
            self._fatal("operation cancelled")
            return
        exc = task.exception()
        if exc is not None:
            log.error("request failed", peer=self.peer, error=repr(exc), exc_info=exc)
            self.counters["internal_errors"] += 1
            self._fatal("internal error")
            return
        result = task.result()
        if self.closed:
            # The peer left while we waited: give back what the operation handed us.
            if isinstance(result, Entry):
                self.store.release(result)
            return
        then(result)
        self._process()

    def _update_reading(self) -> None:
        if self.closed or self.transport is None:
            return
        idle_closing = self.closing and self.body is None and not self.discard_left
        pause = self.busy or self.write_paused or idle_closing or self._acks_full
        if pause != self.reading_paused:  # called after every read: only changes reach the transport
            self.reading_paused = pause
            if pause:
                self.transport.pause_reading()
            else:
                self.transport.resume_reading()


def sweep_interval(config: Any) -> float:
    """How often timeouts are checked: a quarter of the shortest one, within 50 ms - 1 s."""
    timeouts = [t for t in (config.idle_timeout, config.header_timeout, config.body_timeout) if t]
    return min(1.0, max(0.05, min(timeouts, default=4.0) / 4))


async def sweep(state: ServerState) -> None:
    """Check every connection's timeouts and staging buffer, forever (a server task)."""
    config = state.config
    interval = sweep_interval(config)
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval)
        now = loop.time()
        close_idle = len(state.connections) + len(state.handshakes) > config.max_connections * 3 // 4
        for connection in list(state.connections):
            connection.tick(now, close_idle)


COMMAND_SLOTS: Final = max(Command) + 1
EXIST_HITS_SLOT: Final = 0
"""``by_command`` slot 0 (no command has number 0) counts EXISTs that found their key."""

# Plain ints: a set of IntEnum members answers `int in set` through a rich compare per hit.
_ANSWERED_INLINE: Final = frozenset(
    int(c) for c in (Command.EXIST, Command.HEALTH, Command.LIST, Command.STATS)
)
"""Commands whose handler only queues a reply: serving one cannot stop the parse loop."""
