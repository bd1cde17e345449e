"""The commands a connection answers from memory or by waiting on the store: everything but
PUT, whose body the protocol receives (protocol.py).

Strategy: each handler is a method taking the decoded request and its (small, control) body,
and queues its answer on the connection's ``Replies``. What can be answered from memory is
answered inline (EXIST, a GET memory holds, HEALTH, LIST, STATS); what must wait (a GET from a
tier behind memory, DELETE, DELETE_MANY) hands an awaitable to ``wait``, the protocol's, which
stops parsing until its continuation has run. DELETE_MANY and LIST_PAGE, the commands over
many keys (SPEC 8.10, 8.11), are functions of the Store and the request here too.

Counts the hot path makes (GET hits and their bytes, EXIST hits) are plain ints, added to the
server's counters by the protocol's ``add_counts``: a counter update per request was ~6% of
a pipelined 4 KiB GET.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, final

from lmproto import (
    MAX_PAGE_KEYS,
    PLACEHOLDER_META,
    UNKNOWN_SIZE,
    Command,
    MalformedBody,
    Request,
    Status,
    decode_key_list,
    decode_page_request,
    encode_json,
    encode_key_lines,
    encode_page,
    encode_presence,
    encode_reply,
)

from ..state import ServerState
from ..stats import server_stats
from ..storage.memory import Entry
from ..storage.store import Store
from .replies import SMALL_REPLY, Replies

LIST_BATCH: Final = 1024
"""Keys encoded at once into a LIST reply."""

Wait = Callable[[Awaitable[Any], Callable[[Any], None]], None]
"""``wait(awaitable, then)``: run ``awaitable``, parse nothing until ``then(result)`` ran."""

_SUCCESS: Final = int(Status.SUCCESS)
_FAIL: Final = int(Status.FAIL)


def _not_waiting(awaitable: Awaitable[Any], then: Callable[[Any], None]) -> None:
    raise RuntimeError("a request served before connection_made")


@final
class Handlers:
    """One connection's command handlers (see the module docstring)."""

    def __init__(self, state: ServerState, replies: Replies) -> None:
        self.state = state
        self.store: Store = state.store
        self.config = state.config
        self.counters = state.counters
        self.replies = replies
        self.small_reply = SMALL_REPLY  # GET replies up to this are copied (bench/hotpath.py varies it)
        # The protocol's (set when it connects, cleared when it closes: a bound method of the
        # protocol here is a reference cycle).
        self.wait: Wait = _not_waiting
        # Counts not yet in the server's counters (the protocol's add_counts takes them).
        self.gets = 0  # GET hits
        self.get_bytes = 0  # their bytes
        self.exist_hits = 0  # EXISTs that found their key
        self.timed_since = 0.0  # when the request now waited on began (latency metrics)

    def table(self) -> dict[int, Callable[[Request, memoryview], None]]:
        """The handler of each command without an object body, by command number."""
        return {
            Command.GET: self.get,
            Command.EXIST: self.exist,
            Command.LIST: self.list_keys,
            Command.HEALTH: self.health,
            Command.DELETE: self.delete,
            Command.EXIST_MANY: self.exist_many,
            Command.STATS: self.stats,
            Command.DELETE_MANY: self.delete_many,
            Command.LIST_PAGE: self.list_page,
        }

    # -- lookups (the hot path) -------------------------------------------------------------

    def get(self, req: Request, body: memoryview) -> None:
        self.get_key(req.key)

    def get_key(self, key: str) -> None:
        entry = self.store.read(key, self.small_reply, self.replies.copier)
        if entry is not None:
            length = entry.length
            self.replies.object(entry, length <= self.small_reply, self.small_reply)
            self.gets += 1  # as reply_object counts, inline: the hot path
            self.get_bytes += length
        elif self.store.in_lower(key):
            self.time_start()
            self.wait(self.store.fetch(key), self.reply_fetched)
        else:
            self.reply_miss()

    def reply_object(self, entry: Entry, copied: bool) -> None:
        self.replies.object(entry, copied, self.small_reply)
        self.gets += 1
        self.get_bytes += entry.length

    def reply_fetched(self, entry: Entry | None) -> None:
        self.time_end(Command.GET)
        if entry is None:
            self.reply_miss()
        else:
            self.reply_object(entry, False)

    def reply_miss(self) -> None:
        self.counters["gets_missed"] += 1
        self.replies.emit_canned(_FAIL)

    def exist(self, req: Request, body: memoryview) -> None:
        self.exist_hits += self.exist_key(req.key)

    def exist_key(self, key: str) -> int:
        """Answer an EXIST; 1 for a hit, 0 for a miss (the caller counts hits)."""
        replies = self.replies
        if self.store.contains(key):
            replies.emit_one(replies.canned_hit)
            return 1
        replies.emit_one(replies.canned_miss)
        return 0

    def exist_many(self, req: Request, body: memoryview) -> None:
        try:
            keys = decode_key_list(body)
        except MalformedBody as exc:
            self.malformed(exc)
            return
        contains = self.store.contains
        self.replies.reply(_SUCCESS, encode_presence([contains(k) for k in keys]))

    # -- the rest -------------------------------------------------------------------------------

    def health(self, req: Request, body: memoryview) -> None:
        self.replies.emit_canned(_FAIL if self.state.shutting_down else _SUCCESS)

    def stats(self, req: Request, body: memoryview) -> None:
        self.replies.reply(_SUCCESS, encode_json(server_stats(self.state)))

    def delete(self, req: Request, body: memoryview) -> None:
        self.time_start()
        self.wait(self.store.delete(req.key), self.reply_deleted)

    def reply_deleted(self, found: bool) -> None:
        self.time_end(Command.DELETE)
        self.replies.emit_canned(_SUCCESS if found else int(Status.NOT_FOUND))

    def delete_many(self, req: Request, body: memoryview) -> None:
        try:
            keys = decode_key_list(body)
        except MalformedBody as exc:
            self.malformed(exc)
            return
        self.time_start()
        self.wait(delete_many(self.store, keys), self.reply_many_deleted)

    def reply_many_deleted(self, presence: bytes) -> None:
        self.time_end(Command.DELETE_MANY)
        self.replies.reply(_SUCCESS, presence)

    def list_keys(self, req: Request, body: memoryview) -> None:
        # Encoded in batches, so no second whole copy of a long reply exists outside the
        # memory budget (see reply_held).
        keys = self.store.keys(req.key, self.config.max_list_keys)
        if not keys:
            self.replies.emit_canned(_SUCCESS)
            return
        chunks = [encode_key_lines(keys[i : i + LIST_BATCH]) for i in range(0, len(keys), LIST_BATCH)]
        del keys
        if not self.reply_held(chunks, b"\n"):
            self.replies.emit_canned(_FAIL)  # an upstream command: 400, length 0

    def list_page(self, req: Request, body: memoryview) -> None:
        try:
            limit, after = decode_page_request(body)
        except MalformedBody as exc:
            self.malformed(exc)
            return
        page = list_page(self.store, req.key, after, min(limit, self.config.max_list_keys))
        if not self.reply_held([page]):
            self.replies.reply_error(int(Status.NO_SPACE), "no memory for the reply")

    def reply_held(self, chunks: list[bytes], separator: bytes = b"") -> bool:
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
        replies = self.replies
        header = encode_reply(_SUCCESS, entry.length, generation=replies.generation, meta=PLACEHOLDER_META)
        replies.emit(header, entry.view, pin=entry)
        return True

    def malformed(self, exc: MalformedBody) -> None:
        self.counters["bad_requests"] += 1
        self.replies.reply_error(_FAIL, str(exc))

    # -- latency of requests that are not answered inline (metrics) ----------------------

    def time_start(self) -> None:
        if self.state.latency is not None:
            self.timed_since = time.perf_counter()

    def time_end(self, command: int, started: float | None = None) -> None:
        latency = self.state.latency
        if latency is not None:
            since = self.timed_since if started is None else started
            latency.record(command, time.perf_counter() - since)


async def delete_many(store: Store, keys: Sequence[str]) -> bytes:
    """Delete every key; the DELETE_MANY reply body (1: deleted, 0: no tier held it).

    With tiers behind memory the deletes wait for tier jobs, so they run concurrently; with
    memory alone none of them suspends, and awaiting each in turn saves a task per key."""
    if store.links:
        return encode_presence(await asyncio.gather(*(store.delete(key) for key in keys)))
    return encode_presence([await store.delete(key) for key in keys])


def list_page(store: Store, prefix: str, after: str, limit: int) -> bytes:
    """The LIST_PAGE reply body: up to ``limit`` keys (and sizes) starting with ``prefix``
    that sort after ``after``, in key order, and whether more follow. A key held only by a
    tier behind memory has no size known without I/O (``UNKNOWN_SIZE``)."""
    keys = store.keys(prefix)
    start = bisect.bisect_right(keys, after) if after else 0
    page = keys[start : start + min(limit, MAX_PAGE_KEYS)]
    more = start + len(page) < len(keys)
    entries = []
    for key in page:
        size = store.size_in_memory(key)
        entries.append((key, UNKNOWN_SIZE if size is None else size))
    return encode_page(entries, more)
