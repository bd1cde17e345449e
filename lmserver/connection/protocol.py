"""One client connection: a BufferedProtocol state machine, header -> body -> dispatch.

Strategy (the parts, each in its own module):

* ``staging.py``: where received bytes go. Headers are parsed many per read from a staging
  buffer, so a burst of pipelined small requests costs one wakeup and one reply write; the
  rest of a PUT body is received straight into the memory entry it will be stored in.
* ``replies.py``: replies queued in order and written together at the end of a read
  callback, small ones copied into one buffer, large ones zero-copy and pinned until sent,
  with the transport's flow control as the backpressure (nothing is read while anything is
  unsent).
* ``phase.py``: where the connection stands, and every "may it parse / close / read?" asked
  in one place.
* ``handlers.py``: the commands other than PUT.
* ``sweep.py``: timeouts, checked by a periodic sweep, never per request.

This module ties them together: it parses, dispatches, receives PUT bodies, waits for what
must be waited for, and runs the connection's lifecycle. Requests are answered strictly in
order. Memory operations are answered inline; an operation that must wait (a lower-tier read,
a DELETE, a PUT waiting for memory) pauses reading until it is done, then parsing resumes
where it stopped. A PUT_ACK waiting for its disk write does not stop the pipeline (the object
is already visible): its reply, and every reply after it, are held in order until the write is
known (``Replies.hold_ack``).

A PUT's memory is charged as its body arrives, not when its header announces it: a fresh
buffer (an untouched anonymous mmap, see storage/pool.py) is charged for what is already
staged plus one staging size, and the socket may fill only the charged part. Each time it is
full the charge doubles (evicting LRU objects as needed, or waiting up to ``--memory-wait``
for pinned memory, then refusing the rest of the body). A header that announces 1 GiB and
sends nothing holds 64 KiB, so it can neither flush the cache nor block other PUTs; a body
that stops for ``--body-timeout`` is cut off. A reused buffer is already resident and counted,
so it is charged in full at once (the fast path).
"""

from __future__ import annotations

import asyncio
import fcntl
import socket
import sys
import termios
from collections.abc import Awaitable, Callable
from typing import Any, Final, final

import structlog

from lmproto import (
    EXTENSION_COMMANDS,
    MAX_CONTROL_BODY,
    NO_META,
    REQUEST_SIZE,
    Command,
    Generation,
    RemoteProtocolError,
    Request,
    Status,
    decode_lookups_into,
    decode_request,
    detect_generation,
)

from ..logs import ThrottledWarnings
from ..plain import Receiver
from ..state import ServerState
from ..storage.memory import Entry
from ..tls import write_buffer_high_water
from .handlers import Handlers
from .phase import Phase
from .replies import Held, Replies
from .staging import EMPTY, STAGING_SIZE, Staging
from .sweep import IDLE, REASONS, Progress

log = structlog.get_logger("lmserver.connection")
throttled = ThrottledWarnings(log)

LINGER_S: Final = 2.0
"""How long a gracefully closed connection keeps reading (and dropping) what the peer sends."""

COMMAND_SLOTS: Final = max(Command) + 1
EXIST_HITS_SLOT: Final = 0
"""``by_command`` slot 0 (no command has number 0) counts EXISTs that found their key."""

# Plain ints: cheaper dict keys and comparisons on the hot path.
_SUCCESS: Final = int(Status.SUCCESS)
_FAIL: Final = int(Status.FAIL)
_EXIST: Final = int(Command.EXIST)
_PUT: Final = int(Command.PUT)
_PUT_ACK: Final = int(Command.PUT_ACK)
# Not compiled by mypyc (a C twin): Final, so not looked up in the module dict per call.
_decode_lookups_into: Final = decode_lookups_into
# A set of IntEnum members answers `int in set` through a rich compare per hit.
_ANSWERED_INLINE: Final = frozenset(
    int(c) for c in (Command.EXIST, Command.HEALTH, Command.LIST, Command.STATS)
)
"""Commands whose handler only queues a reply: serving one cannot stop the parse loop."""
_GENERATIONS: Final = {"v0": Generation.V0, "v1": Generation.V1}


def _unread_input(transport: asyncio.BaseTransport) -> bool:
    """Whether the kernel holds bytes from the peer that nobody has read (FIONREAD)."""
    sock = transport.get_extra_info("socket")
    try:
        raw = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (AttributeError, OSError, ValueError):
        return True  # unknown: assume there is, and linger
    return int.from_bytes(raw, sys.byteorder) > 0


@final
class LMProtocol(Receiver):
    def __init__(self, state: ServerState, address: str | None = None) -> None:
        self.state = state
        self.store = state.store
        self.config = state.config
        self.counters = state.counters

        self.staging = Staging()
        self.replies = Replies(self.store.release)
        self.phase = Phase(self.staging, self.replies)
        self.handlers = Handlers(state, self.replies)
        self.progress = Progress()

        self.transport: asyncio.Transport | None = None
        self.peer: Any = None
        # The frame generation: set by --protocol, or detected from the first header.
        self.generation: Generation | None = _GENERATIONS.get(self.config.protocol)
        self._request_size = 0  # set by _use_generation
        # EXIST's two answers as (miss, hit), as ReplyBuffer.add_exists takes them. Typed as
        # a variable-length tuple: compiled, a tuple[bytes, bytes] is kept unboxed, and boxed
        # anew for every call.
        self._canned_exist: tuple[bytes, ...] = (b"", b"")
        if self.generation is not None:
            self._use_generation(self.generation)
        self._add_exists: Callable[..., tuple[int, int]] = self.replies.buffer.add_exists
        # What add_exists looks keys up in: the memory tier's dicts. With tiers behind memory,
        # a key memory lacks may be in one of them, so a run stops at it (Store.contains).
        self._exist_dicts: tuple[dict[str, Any], ...] = self.store.exist_index()
        self._exist_stops_at_miss = bool(self.store.links)
        self.reading_paused = False  # what we last asked of the transport
        # The peer address whose slot (admission.py) this connection holds, given back on close.
        self.address = address
        # A TLS connection's handshake (admission.PendingHandshake), whose slot it takes over.
        self.handshake: Any = None

        # Bytes received and requests parsed, counted on the read path: the timeout sweep
        # compares them with what it saw last time, and add_counts adds what they grew by
        # since it last ran to the server's counters (a counter update per read was ~6% of a
        # pipelined 4 KiB GET).
        self.received = 0
        self.parsed = 0
        self.received_counted = 0
        self.parsed_counted = 0
        # Requests by command number (plus EXIST hits in slot 0), plain ints for metrics:
        # cheaper on the hot path than string-keyed counters; folded into the state on close.
        self.by_command = [0] * COMMAND_SLOTS
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

        # The PUT (or control body) being received, and what runs when it is complete.
        self.body_request: Request | None = None
        self.body_done: Callable[[], None] | None = None
        self.body_entry: Entry | None = None  # its reservation, aborted if cut short

        # Filled by connection_made: bound methods of the handlers refer back to this
        # protocol (their wait), which a protocol that never connects (a failed TLS
        # handshake) must not carry.
        self._handlers: dict[int, Callable[[Request, memoryview], None]] = {}

    @property
    def small_reply(self) -> int:
        """GET replies up to this size are copied into the reply buffer (replies.SMALL_REPLY)."""
        return self.handlers.small_reply

    @small_reply.setter
    def small_reply(self, size: int) -> None:
        self.handlers.small_reply = size

    # -- connection lifecycle -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Admitted when accepted (admission.py): --allow and the limits were applied then.
        if self.handshake is not None:
            self.handshake.hand_over(self)
            self.handshake = None
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass
        self.peer = transport.get_extra_info("peername")
        if self.state.shutting_down:  # a TLS handshake that finished during the shutdown
            self.phase.closed = True
            transport.abort()  # type: ignore[attr-defined]
            return
        self.handlers.wait = self._await
        self._handlers = self.handlers.table()
        self.progress = Progress(asyncio.get_running_loop().time())
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        high = write_buffer_high_water(transport)  # 0, or 1 on TLS: see tls.py
        transport.set_write_buffer_limits(high=high, low=0)  # type: ignore[attr-defined]
        self.replies.attach(transport, sock)
        self.state.connections.add(self)
        self.state.no_connections.clear()
        self.counters["connections_accepted"] += 1
        log.debug("connection open", peer=self.peer, connections=len(self.state.connections))

    def connection_lost(self, exc: Exception | None) -> None:
        self.phase.closed = True
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
        self.replies.release_all()
        self.body_request = self.body_done = None
        self.staging.close()
        self._handlers = {}
        self.handlers.wait = _closed_wait
        log.debug("connection closed", peer=self.peer, error=repr(exc) if exc else None)

    def eof_received(self) -> bool:
        if self.phase.in_request():
            log.debug("peer closed mid-request", peer=self.peer, unparsed=self.staging.staged)
        return False  # close our side too

    def shutdown(self) -> None:
        """Graceful stop: serve the requests already received (finishing a body in
        progress), read nothing new, then close."""
        if not self.phase.closing:
            self.phase.closing = True
            self._process()

    def _linger_close(self) -> None:
        """Close without losing replies: send FIN after the last reply and drop whatever
        the peer still sends until it closes too (or LINGER_S passes). Closing outright
        with unread bytes in the socket makes the kernel send RST, which can discard
        replies the peer has not read yet."""
        self.phase.closed = True
        transport = self.transport
        assert transport is not None
        if not _unread_input(transport) or not transport.can_write_eof():
            transport.close()  # nothing unread: a plain close sends FIN, not RST
            return
        transport.write_eof()
        self.staging.drop_all()
        transport.resume_reading()  # buffer_updated drops everything once closed
        self.reading_paused = False
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)

    def _fatal(self, reason: str) -> None:
        """The stream can no longer be framed: log, count, and close this connection only."""
        self.counters["protocol_errors"] += 1
        throttled.warning("protocol error, closing connection", peer=self.peer, reason=reason)
        self._flush()
        self.phase.closed = True
        assert self.transport is not None
        self.transport.close()

    # -- timeouts (sweep.py) --------------------------------------------------------------

    def tick(self, now: float, close_idle: bool) -> None:
        """One sweep: give back an unused staging buffer, and close the connection if it is
        past a timeout. ``close_idle``: the server is short of connections, so idle ones
        past ``--idle-timeout`` make room."""
        if self.phase.closed:
            return
        staging = self.staging
        if not self.progress.received_since(now, self.received) and staging.end == 0:
            staging.give()  # nothing staged and nothing received since the last sweep
            if not len(self.replies.buffer):  # every turn ends with a flush: empty but for a wait
                self.replies.buffer.release()
        verdict = self.progress.verdict(now, self.config, self.phase, self.parsed, self._unsent, close_idle)
        if verdict == IDLE:
            self.counters["idle_closed"] += 1
            idle_s = round(now - self.progress.quiet_since, 1)
            log.debug("closing idle connection", peer=self.peer, idle_s=idle_s)
            self._linger_close()
        elif verdict is not None:
            self._time_out(verdict, REASONS[verdict])

    def _unsent(self) -> int:
        assert self.transport is not None
        return self.transport.get_write_buffer_size()

    def idle_since(self, now: float) -> float | None:
        """Since when (loop time) this connection has waited for its peer with nothing in
        progress: ``now`` if bytes came since the last sweep; None while a request is in
        progress (a body, a partial header, an operation, replies unsent or held)."""
        if self.phase.in_request():
            return None
        return self.progress.idle_since(now, self.received)

    def displace(self) -> None:
        """Make room for a newcomer at --max-connections (admission.py): this connection is
        idle, so nothing in progress is lost; closed at once, its slot free on the next turn."""
        log.debug("idle connection displaced by a newcomer", peer=self.peer)
        self.phase.closed = True
        assert self.transport is not None
        self.transport.abort()

    def _time_out(self, counter: str, reason: str) -> None:
        """The peer stopped making progress: drop the connection (and what it reserved)."""
        self.counters[counter] += 1
        throttled.warning("connection timed out", peer=self.peer, reason=reason)
        self.phase.closed = True
        assert self.transport is not None
        self.transport.abort()  # close() would wait for unsent replies the peer never reads

    # -- reading --------------------------------------------------------------------------

    def get_buffer(self, sizehint: int) -> memoryview:
        staging = self.staging
        if not staging.end and staging.body is None and staging.view is not EMPTY:
            return staging.view  # Staging.get_buffer's common case, inline: the hot path
        return staging.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        staging = self.staging
        if self.phase.closed:
            staging.drop_all()  # closing: what still arrives is dropped
            return
        self.received += nbytes
        body = staging.body
        if body is not None:
            staging.body_pos += nbytes
            if staging.body_pos == staging.body_limit:
                if staging.body_pos == len(body):
                    self._body_complete()
                else:
                    self._grow_body()
        elif staging.discard_left:
            staging.received(nbytes)
        else:
            staging.end += nbytes  # Staging.received's common case, inline: the hot path
        self._process()

    def _process(self) -> None:
        """Parse and serve staged requests until data runs out or something must wait."""
        if self.generation is None:
            staging = self.staging
            generation = detect_generation(staging.view[: staging.end], staging.start)
            if generation is not None:
                self._use_generation(generation)
        if self.generation is not None:
            self._serve_staged(self.generation)
        replies = self.replies
        if not self.phase.closed:
            replies.flush()
        if replies.owe_ack:
            replies.ack_now()
        phase = self.phase
        if phase.closing and phase.may_close():  # closing: a plain attribute, read first
            self._linger_close()
        if not phase.closed:  # _update_reading, inline (once per read)
            pause = phase.should_pause_reading()
            if pause != self.reading_paused:
                self._set_reading(pause)

    def _serve_staged(self, generation: Generation) -> None:
        # The hot loop of pipelined small requests: keep its per-request work minimal.
        size = self._request_size
        staging = self.staging
        view = staging.view
        replies = self.replies
        # Requests by command, counted as runs of one command (a pipelined burst is usually one
        # run): a local small-int add per request instead of a list update.
        last, run = self.run_command, self.run_count
        served = 0
        check = True  # whether the last request may have changed what may_parse says
        while staging.end - staging.start >= size:
            if check and not self.phase.may_parse():
                break
            if last == _EXIST and not replies.held:
                # A connection that is looking keys up (LMCache: one EXIST per chunk, in
                # order) mostly goes on doing so: its run of EXISTs answered in one C call,
                # each key looked up and its reply queued with no object made for it but the
                # key's str. It stops where something else must decide (another command, a
                # key its scan does not take, a key memory lacks with tiers behind it).
                done, hits = self._add_exists(
                    view,
                    generation,
                    staging.start,
                    staging.end,
                    self._exist_dicts,
                    self._canned_exist,
                    self._exist_stops_at_miss,
                )
                if done:
                    self.handlers.exist_hits += hits
                    # Staging.consume, inline: a call is a tenth of a sequential EXIST's work here.
                    staging.start += done * size
                    if staging.start == staging.end:
                        staging.start = staging.end = 0
                    served += done
                    run += done
                    check = False
                    if replies.full():
                        self._flush()
                        check = True
                    continue
            # EXIST and GET without a body and with a valid key, the bulk of a pipelined burst,
            # need only the command and key: one decode_lookups_into call takes a whole run of them
            # (no Request built). Every other header takes decode_request.
            keys = self.lookup_keys
            command = _decode_lookups_into(view, generation, staging.start, staging.end, keys)
            if keys:
                handlers = self.handlers
                if command == _EXIST:
                    # Answered inline, and nothing may_parse reads changes: the run at once.
                    hits = 0
                    for key in keys:
                        hits += handlers.exist_key(key)
                    handlers.exist_hits += hits
                    done = len(keys)
                    staging.consume(done * size)
                    check = False
                else:
                    done = 0
                    for key in keys:  # one at a time: a GET may start a fetch or fill the socket
                        staging.start += size  # Staging.consume, inline (see above)
                        if staging.start == staging.end:
                            staging.start = staging.end = 0
                        done += 1
                        handlers.get_key(key)
                        if replies.full():
                            self._flush()
                        if not self.phase.may_parse():
                            break  # the rest of the run is decoded again when it can go on
                    check = True
                served += done
            else:
                try:
                    request = decode_request(view, generation, staging.start)
                except RemoteProtocolError as exc:
                    self._fatal(str(exc))
                    break
                staging.consume(size)
                served += 1
                table = self._handlers
                if request.length or request.problem is not None or command not in table:
                    self._on_header(request)  # counts the request itself
                    done = 0
                    check = True
                else:
                    table[command](request, EMPTY)
                    done = 1
                    check = command not in _ANSWERED_INLINE
            if command == last:
                run += done
            elif done:
                if run:
                    self.by_command[last] += run
                last, run = command, done
            if replies.full():
                self._flush()
                check = True
        self.run_command, self.run_count = last, run
        self.parsed += served

    # -- request headers ------------------------------------------------------------------

    def _on_header(self, req: Request) -> None:
        command = req.command
        if req.problem is not None:
            self._refuse(req, Status.FAIL, req.problem, counter="bad_requests")
            return
        self.by_command[command] += 1
        if command in (_PUT, _PUT_ACK):
            # A PUT_ACK's reply comes later, maybe held; a PUT's ACK is owed now.
            self.replies.owe_ack |= command == _PUT
            self.handlers.time_start()
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
            self._handlers[command](req, EMPTY)

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
            self.replies.reply_error(status, reason)
        else:
            self.replies.emit_canned(_FAIL)  # upstream commands: 400, length 0, nothing else
        self.staging.discard(req.length)

    def _dispatch_scratch(self, req: Request, scratch: Entry) -> None:
        self.body_entry = None
        try:
            self._handlers[req.command](req, scratch.view)
        finally:
            self.store.abort(scratch)

    # -- bodies ---------------------------------------------------------------------------

    def _receive_body(self, target: memoryview, done: Callable[[], None]) -> None:
        """Fill ``target`` with the body: first from staging, then straight from the socket."""
        if self.staging.begin_body(target) == len(target):
            done()
        else:
            self.body_done = done

    def _body_complete(self) -> None:
        done = self.body_done
        self.staging.end_body()
        self.body_done = self.body_request = None
        assert done is not None
        done()

    def _grow_body(self) -> None:
        """The charged part of a PUT's buffer is full: charge more before reading on."""
        entry, staging = self.body_entry, self.staging
        body = staging.body
        assert entry is not None and body is not None
        pos = staging.body_pos
        want = min(len(body), max(2 * pos, pos + STAGING_SIZE))
        if want == len(body):
            want = len(entry.buffer)  # all of it: a fully charged buffer is reused later
        if self.store.grow(entry, want):
            self._body_grown(True)
        else:
            self._await(self.store.grow_wait(entry, want, self.config.memory_wait), self._body_grown)

    def _body_grown(self, ok: bool) -> None:
        entry, staging, req = self.body_entry, self.staging, self.body_request
        body = staging.body
        assert entry is not None and body is not None and req is not None
        if ok:
            staging.body_limit = min(entry.charged, len(body))
            return
        # No memory for the rest of the body: give back what it holds, answer, drop the rest.
        remaining = len(body) - staging.body_pos
        self.body_entry = self.body_done = self.body_request = None
        staging.end_body()
        self.store.abort(entry)
        self._refuse(req, Status.NO_SPACE, "memory is full of objects in use", counter="refused_no_space")
        staging.discard_left = remaining

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
        first = self.staging.staged + STAGING_SIZE
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
            self.handlers.time_end(req.command)
            self._refuse(req, Status.NO_SPACE, "memory is full of objects in use", counter="refused_no_space")
            return
        self.body_entry = entry
        self.body_request = req
        self._receive_body(memoryview(entry.buffer)[: req.length], lambda: self._finish_put(req, entry, room))
        staging = self.staging
        if staging.body is not None:
            staging.body_limit = min(entry.charged, req.length)
            if staging.body_pos == staging.body_limit:
                self._grow_body()

    def _finish_put(self, req: Request, entry: Entry, room: bool) -> None:
        self.body_entry = self.body_request = None
        acknowledged = req.command == Command.PUT_ACK
        meta = req.meta if req.generation == Generation.V1 else NO_META
        persisted = self.store.commit(req.key, entry, meta, acknowledged=acknowledged, room=room)
        self.counters["puts"] += 1
        self.counters["put_bytes"] += req.length
        if not acknowledged or persisted is None:
            self.handlers.time_end(req.command)
            if acknowledged:
                self.replies.emit_canned(_SUCCESS)
            else:
                self.replies.owe_ack = True
            return
        slot = self.replies.hold_ack(self.handlers.timed_since)
        persisted.add_done_callback(lambda done: self._ack_persisted(slot, done.result()))

    def _ack_persisted(self, slot: Held, ok: bool) -> None:
        self.replies.acks_in_flight -= 1
        if self.phase.closed:
            return
        self.handlers.time_end(Command.PUT_ACK, slot.started)  # others may be timed meanwhile
        self.replies.ack_known(slot, ok, self.store.links[0].name if self.store.links else "")
        self._process()

    # -- replies --------------------------------------------------------------------------

    def _use_generation(self, generation: Generation) -> None:
        self.generation = generation
        self.replies.use_generation(generation)
        self._canned_exist = (self.replies.canned_miss, self.replies.canned_hit)
        # Kept as a plain int: REQUEST_SIZE[generation] hashes an IntEnum, which Enum does in
        # Python, once per read.
        self._request_size = REQUEST_SIZE[generation]

    def _flush(self) -> None:
        if not self.phase.closed:
            self.replies.flush()

    def pause_writing(self) -> None:
        self.replies.write_paused = True
        self._update_reading()

    def resume_writing(self) -> None:
        if self.replies.drained():
            self._process()

    def buffer_bytes(self) -> int:
        """Memory this connection holds outside ``--memory-limit``: its staging buffer and its
        reply buffer's capacity (both given back when it goes quiet)."""
        return self.staging.holding + self.replies.holding

    def add_counts(self) -> None:
        """Add what this connection counted in plain ints to the server's counters and to
        its own by_command."""
        if self.run_count:
            self.by_command[self.run_command] += self.run_count
            self.run_count = 0
        handlers = self.handlers
        if handlers.exist_hits:
            self.by_command[EXIST_HITS_SLOT] += handlers.exist_hits
            handlers.exist_hits = 0
        counters = self.counters
        counters["requests"] += self.parsed - self.parsed_counted
        counters["bytes_received"] += self.received - self.received_counted
        counters["gets_served"] += handlers.gets
        counters["get_bytes"] += handlers.get_bytes
        self.parsed_counted, self.received_counted = self.parsed, self.received
        handlers.gets = handlers.get_bytes = 0

    # -- waiting ------------------------------------------------------------------------

    def _await(self, awaitable: Awaitable[Any], then: Callable[[Any], None]) -> None:
        """Run ``awaitable``; parsing stops until ``then(result)`` has run."""
        self.phase.busy = True
        self._flush()
        task = asyncio.ensure_future(awaitable)
        self.state.tasks.add(task)
        task.add_done_callback(lambda t: self._resume(t, then))

    def _resume(self, task: asyncio.Future[Any], then: Callable[[Any], None]) -> None:
        self.state.tasks.discard(task)
        self.phase.busy = False
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
        if self.phase.closed:
            # The peer left while we waited: give back what the operation handed us.
            if isinstance(result, Entry):
                self.store.release(result)
            return
        then(result)
        self._process()

    def _update_reading(self) -> None:
        if not self.phase.closed:
            pause = self.phase.should_pause_reading()
            if pause != self.reading_paused:  # only changes reach the transport
                self._set_reading(pause)

    def _set_reading(self, pause: bool) -> None:
        transport = self.transport
        if transport is None:
            return
        self.reading_paused = pause
        if pause:
            transport.pause_reading()
        else:
            transport.resume_reading()


def _closed_wait(awaitable: Awaitable[Any], then: Callable[[Any], None]) -> None:
    """A closed connection's: nothing more is served (close the awaitable unrun)."""
    if asyncio.iscoroutine(awaitable):
        awaitable.close()
