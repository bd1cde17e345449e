"""``send_nowait``: a reply written straight to the connection's socket; ``recv_nowait``: a
read from it, for the plain transport; ``ReplyBuffer``: the
small replies of one turn, copied one behind the other into one buffer and sent with one call.

Strategy: two twins with one behaviour, as lmproto/_lookup_py.py. ``_framed_c.c`` is what a
build compiles and the selector ``_framed.py`` imports when it is there; this file is the
reference and the pure build, and tests/test_framed_twins.py compares the two.

``send_nowait`` is how a reply leaves when the transport has nothing queued: one ``send(2)``,
as uvloop's own ``write`` starts, without the method lookup, argument parsing and queue
bookkeeping around it (~1,800 instructions of a ~7,500 instruction sequential EXIST, whole
process). ``os.write`` would do, but it releases and retakes the GIL around the call (~1,100
instructions); the C twin keeps the GIL, as uvloop does for its writes, since a non-blocking
send never waits.

Why ``ReplyBuffer``: a connection's small replies (bodiless answers, and GET replies of small
objects, which the memory tier copies out under its shard lock with ``add_framed``: header and
object in one copy, the object's length read from the header) used to be one new bytes object
each, joined or handed to ``writelines`` at the end of the turn. A 4 KiB reply is above the
sizes glibc's malloc keeps at hand, so each cost a full ``malloc`` and ``free``, and 16
pipelined ones a 16-buffer ``writelines``. Here they land in one buffer the connection keeps
while it is busy, and leave with one ``send``.
The buffer grows as needed (the connection sends it before it passes ``REPLY_BUFFER_FLUSH``)
and ``release`` frees it when the connection goes quiet. The C twin's memory is an anonymous
mapping, as the staging buffers' are, so a released buffer goes back to the OS instead of
leaving a hole in malloc's heap; this twin's is a bytearray.
"""

from __future__ import annotations

import mmap
import os

from lmproto._constants import REQUEST_SIZE, V0_REPLY, Command, Generation
from lmproto._lookup import decode_lookup

from ._shard import shard_index

Buffer = bytes | bytearray | memoryview | mmap.mmap


def send_nowait(fd: int, data: Buffer) -> int:
    """Write what ``data`` holds to the non-blocking socket ``fd`` with one ``send(2)``;
    returns the number of bytes sent, 0 if none could be (the socket buffer is full, the peer
    is gone, ``fd`` is closed: the caller hands the rest to the transport, which finds the same
    error and reports it). Raises ValueError unless ``0 <= fd <= 2**31 - 1``, TypeError if
    ``fd`` is not an int or ``data`` not a buffer of bytes."""
    if not isinstance(fd, int):
        raise TypeError(f"fd must be an int, not {type(fd).__name__}")
    if not 0 <= fd <= _FD_MAX:
        raise ValueError(f"fd must be in 0..{_FD_MAX}, not {fd}")
    view = memoryview(data)  # TypeError for what is not a buffer, as the C twin
    try:
        return os.write(fd, view)
    except OSError:
        return 0


def recv_nowait(fd: int, buffer: Buffer) -> int:
    """Read what the non-blocking socket ``fd`` holds into ``buffer`` (writable, not empty)
    with one ``recv(2)``: the number of bytes read, 0 at the peer's end of stream, -1 if there
    is nothing to read yet. OSError for any other failure (a reset connection, a closed
    ``fd``); ValueError for an empty buffer or an ``fd`` out of range, TypeError as
    ``send_nowait``, BufferError for a read-only buffer. The plain transport's read
    (plain.py): one call per readable event."""
    if not isinstance(fd, int):
        raise TypeError(f"fd must be an int, not {type(fd).__name__}")
    if not 0 <= fd <= _FD_MAX:
        raise ValueError(f"fd must be in 0..{_FD_MAX}, not {fd}")
    view = memoryview(buffer)
    if view.readonly:
        raise BufferError("recv_nowait needs a writable buffer")
    if not view.nbytes:
        raise ValueError("recv_nowait into an empty buffer")
    try:
        return os.readv(fd, [view])
    except BlockingIOError:
        return -1


class ReplyBuffer:
    """Replies queued one behind the other; ``len()`` is the number of bytes queued.

    Not thread-safe (a connection's, used from its event loop)."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data = bytearray()

    def __len__(self) -> int:
        return len(self._data)

    def __sizeof__(self) -> int:
        return object.__sizeof__(self) + self._data.__sizeof__()

    def add(self, data: Buffer) -> None:
        """Copy ``data`` behind what is queued. TypeError if ``data`` is not a buffer of bytes."""
        self._data += memoryview(data).cast("B")

    def add_framed(self, header: bytes, buffer: Buffer) -> None:
        """Copy a reply frame behind what is queued: ``header``, then as many bytes from the
        start of ``buffer`` as the header's length field announces (its second little-endian
        int32, as in every reply frame of SPEC.md; a caller that passed the length as an int
        made an int object per 4 KiB GET).

        Raises ValueError if ``header`` is shorter than 8 bytes or its length is not in
        ``0..len(buffer)`` (in bytes), TypeError if ``header`` is not bytes or ``buffer`` not a
        buffer of bytes."""
        if not isinstance(header, bytes):
            raise TypeError(f"header must be bytes, not {type(header).__name__}")
        if len(header) < V0_REPLY.size:  # status and length, what every reply frame begins with
            raise ValueError(f"header must hold a status and a length (8 bytes), not {len(header)} bytes")
        view = memoryview(buffer).cast("B")
        length = V0_REPLY.unpack_from(header)[1]
        if not 0 <= length <= len(view):
            raise ValueError(f"the header's length must be in 0..{len(view)}, not {length}")
        self._data += header
        self._data += view[:length]

    def add_exists(
        self,
        buf: bytes | bytearray | memoryview,
        generation: Generation,
        start: int,
        end: int,
        shards: tuple[dict[str, object], ...],
        replies: tuple[bytes, bytes],
        stop_at_miss: bool,
    ) -> tuple[int, int]:
        """Answer the run of EXIST requests that begins at ``buf[start:end]``: ``(answered,
        hits)``.

        The run is the headers, one behind the other, that ``lmproto.decode_lookup`` answers
        with EXIST and a key (bodiless, the key taken by its scan); it ends at any other header
        or where a whole header no longer fits before ``end``. For each, ``replies[1]`` (hit)
        is copied behind what is queued if the key is in ``shards[shard_index(key,
        len(shards))]``, else ``replies[0]`` (miss); with ``stop_at_miss`` the run ends before
        a key no shard holds instead, for the caller to look further. ``(0, 0)`` when the
        header at ``start`` begins no run.

        The server's EXIST path in one call: no key objects kept, no reply objects made.
        ValueError as ``decode_lookups`` (generation, indices), and for no shards; TypeError
        unless ``shards`` is a tuple of dicts and ``replies`` two bytes. On any error nothing
        is queued."""
        if not isinstance(shards, tuple):
            raise TypeError(f"shards must be a tuple of dicts, not {type(shards).__name__}")
        if not shards:
            raise ValueError("shards must not be empty")
        if not (isinstance(replies, tuple) and len(replies) == 2 and all(type(r) is bytes for r in replies)):
            raise TypeError("replies must be a tuple of two bytes: (miss, hit)")
        if not isinstance(generation, int) or generation not in (0, 1):
            raise ValueError(f"generation must be 0 or 1, not {generation!r}")
        if not isinstance(start, int) or not isinstance(end, int):
            raise TypeError("start and end must be ints")
        size = REQUEST_SIZE[generation]
        if start < 0 or end > memoryview(buf).nbytes or end - start < size:
            raise ValueError("the buffer holds no whole request header at this offset")
        queued = len(self._data)
        answered = hits = 0
        try:
            for at in range(start, end - size + 1, size):
                command, key = decode_lookup(buf, generation, at)
                if command != Command.EXIST or not key:
                    break
                shard = shards[shard_index(key, len(shards))]
                if not isinstance(shard, dict):
                    raise TypeError(f"shards must be a tuple of dicts, not of {type(shard).__name__}")
                found = key in shard
                if not found and stop_at_miss:
                    break
                self._data += replies[found]
                answered += 1
                hits += found
        except BaseException:
            del self._data[queued:]  # nothing half-way: the caller answers none of the run
            raise
        return answered, hits

    def send(self, fd: int) -> int:
        """Write what is queued to the non-blocking socket ``fd`` with one ``send(2)`` and drop
        what went from the front; returns the bytes still queued: 0 once all went (and if
        nothing was queued). Sending fails as ``send_nowait`` does: nothing goes, all stays.

        Not the bytes sent: a count above 256 is a new int object (allocated and freed per
        reply, ~130 instructions of a 4 KiB GET), and 0 is the common answer."""
        sent = send_nowait(fd, self._data)
        del self._data[:sent]
        return len(self._data)

    def take(self) -> bytes:
        """Everything queued, as one bytes object; the buffer is empty after."""
        taken = bytes(self._data)
        self._data.clear()
        return taken

    def release(self) -> None:
        """Drop what is queued and free the memory (the next ``add`` allocates again)."""
        self._data = bytearray()


_FD_MAX = 2**31 - 1
