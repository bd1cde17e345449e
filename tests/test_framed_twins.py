"""lmserver._framed: its C twin (_framed_c.c) gives the same answer and the same error as its
Python twin (_framed_py.py, the reference) for every input, both send, receive and queue replies
as the reference says, and the C twin reads buffers in place exactly as it reads exported ones.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import socket
import struct
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twins import FAST, KINDS, RUN_HEADERS, TWINS, answer, as_buffer, chosen, request_header, twin

import lmproto
from lmproto import Command, Generation, _lookup
from lmserver import _framed, _native, _shard
from lmserver import _framed_py as reference


@pytest.fixture(scope="module", params=TWINS)
def framed(request: pytest.FixtureRequest) -> types.ModuleType:
    return twin("lmserver._framed", request.param)


@pytest.fixture(scope="module")
def framed_c() -> types.ModuleType:
    return twin("lmserver._framed", "c")


@pytest.fixture(scope="module")
def lookup_c() -> types.ModuleType:
    return twin("lmproto._lookup", "c")


def test_the_selector_exports_the_twin_it_chose() -> None:
    assert _framed.__name__ in _native.C_TWINS
    for name in ("ReplyBuffer", "send_nowait", "recv_nowait"):
        assert getattr(_framed, name) is getattr(chosen(_framed), name)
    assert isinstance(_framed.send_nowait, types.BuiltinFunctionType) == _framed.COMPILED
    assert isinstance(reference.ReplyBuffer.add, types.FunctionType)
    assert isinstance(_framed.ReplyBuffer.add, types.FunctionType) != _framed.COMPILED


def _frame_header(length: int, rest: bytes = b"h") -> bytes:
    """A reply header as add_framed reads it: a status, the body's length, then anything."""
    return struct.pack("<ii", 200, length) + rest


def _announced(header: bytes) -> int | None:
    """The body length ``header`` announces, None if it is too short to announce one."""
    return struct.unpack_from("<i", header, 4)[0] if len(header) >= 8 else None


FRAME_HEADERS = st.one_of(
    st.builds(_frame_header, st.integers(-3, 5003), st.binary(max_size=200)), st.binary(max_size=12)
)
BUFFER_OPERATIONS = st.one_of(
    st.tuples(st.just("add"), st.binary(max_size=300), KINDS),
    st.tuples(st.just("add_framed"), FRAME_HEADERS, st.binary(max_size=5000), KINDS),
    st.tuples(st.just("take")),
    st.tuples(st.just("release")),
)


def _apply(reply_buffer: Any, operation: tuple[Any, ...]) -> Any:
    """One operation on a ReplyBuffer: its answer (or error) and what the buffer holds after."""
    name, *args = operation
    if name == "add":
        args = [as_buffer(args[1], args[0]) if args[0] or args[1] != "mmap" else b""]  # no empty mmap
    elif name == "add_framed":
        header, data, kind = args
        args = [header, as_buffer(kind, data) if data or kind != "mmap" else b""]
    return answer(getattr(reply_buffer, name), *args), len(reply_buffer)


@FAST
@given(st.lists(BUFFER_OPERATIONS, max_size=12))
def test_reply_buffer_twins_agree(framed_c: types.ModuleType, operations: list[tuple[Any, ...]]) -> None:
    c, python = framed_c.ReplyBuffer(), reference.ReplyBuffer()
    expected = b""
    for operation in operations:
        outcome = _apply(c, operation)
        assert outcome == _apply(python, operation), operation
        name, *args = operation
        if name == "add":
            expected += args[0]
        elif name == "add_framed":
            announced = _announced(args[0])
            if announced is not None and 0 <= announced <= len(args[1]):
                expected += args[0] + args[1][:announced]
        elif name == "take":
            assert outcome[0] == expected
            expected = b""
        elif name == "release":
            expected = b""
        assert outcome[1] == len(expected)
    assert c.take() == python.take() == expected


@pytest.mark.parametrize(
    "args",
    [
        ("add", "text"),
        ("add", None),
        ("add", 3),
        ("add",),
        ("add", b"a", b"b"),
        ("add_framed", _frame_header(5), b"body"),
        ("add_framed", _frame_header(-1), b"body"),
        ("add_framed", _frame_header(-(2**31)), b"body"),
        ("add_framed", _frame_header(2**31 - 1), b"body"),
        ("add_framed", _frame_header(2)[:7], b"body"),
        ("add_framed", b"", b"body"),
        ("add_framed", bytearray(_frame_header(2)), b"body"),
        ("add_framed", "header..", b"body"),
        ("add_framed", _frame_header(2), "body"),
        ("add_framed", _frame_header(2), None),
        ("add_framed", _frame_header(2)[:7], None),
        ("add_framed", _frame_header(2)),
        ("add_framed", _frame_header(2), b"body", 2),
        ("take", 1),
        ("release", 1),
    ],
)
def test_reply_buffer_twins_agree_on_bad_arguments_and_keep_what_they_held(
    framed_c: types.ModuleType, args: tuple[Any, ...]
) -> None:
    name, *rest = args
    c, python = framed_c.ReplyBuffer(), reference.ReplyBuffer()
    for queued in (c, python):
        queued.add(b"kept")
    assert answer(getattr(c, name), *rest) == answer(getattr(python, name), *rest), args
    assert c.take() == python.take() == b"kept"  # nothing half-added


def test_reply_buffer_twins_agree_on_constructor_arguments(framed_c: types.ModuleType) -> None:
    for args in [(1,), (b"",), (None,)]:
        assert answer(framed_c.ReplyBuffer, *args) == answer(reference.ReplyBuffer, *args)


MISS_HIT = (b"miss", b"HIT!")


def _shards_holding(keys: list[str], count: int) -> tuple[dict[str, object], ...]:
    shards: tuple[dict[str, object], ...] = tuple({} for _ in range(count))
    for key in keys:
        shards[_shard.shard_index(key, count)][key] = None
    return shards


def _exists_answer(reply_buffer: Any, *args: Any) -> Any:
    """add_exists's answer (or error) and what the buffer holds after: it had b"kept"."""
    reply_buffer.add(b"kept")
    return answer(reply_buffer.add_exists, *args), reply_buffer.take()


@FAST
@given(
    st.lists(RUN_HEADERS, min_size=1, max_size=12),
    st.sampled_from([0, 1]),
    st.integers(1, 5),
    st.lists(st.booleans(), min_size=12, max_size=12),
    st.booleans(),
    st.integers(0, 200),
    KINDS,
)
def test_add_exists_twins_agree_and_answer_each_exist_of_the_run(
    framed_c: types.ModuleType,
    headers: list[tuple[int, int, bytes, bytes]],
    generation: int,
    count: int,
    held: list[bool],
    stop_at_miss: bool,
    cut: int,
    kind: Any,
) -> None:
    burst = b"".join(request_header(c, n, key, pad, generation) for c, n, key, pad in headers)
    buf = as_buffer(kind, burst + b"tail")
    size = lmproto.REQUEST_SIZE[Generation(generation)]
    keys = [_lookup.decode_lookup(buf, generation, at)[1] for at in range(0, len(burst), size)]
    shards = _shards_holding([k for k, h in zip(keys, held, strict=False) if k and h], count)
    for end in (len(burst), len(burst) - cut, len(buf)):
        args = (buf, generation, 0, end, shards, MISS_HIT, stop_at_miss)
        outcome, queued = _exists_answer(framed_c.ReplyBuffer(), *args)
        assert (outcome, queued) == _exists_answer(reference.ReplyBuffer(), *args), args
        if isinstance(outcome, tuple) and isinstance(outcome[0], type):
            continue  # an error (end before the first whole header): checked alike above
        expected, hits = b"kept", 0  # the run as decode_lookup and shard_index read it
        for at in range(0, end - size + 1, size):
            command, key = _lookup.decode_lookup(buf, generation, at)
            found = bool(key) and key in shards[_shard.shard_index(key, count)]
            if command != Command.EXIST or not key or (stop_at_miss and not found):
                break
            expected += MISS_HIT[found]
            hits += found
        assert outcome == ((len(expected) - 4) // 4, hits)
        assert queued == expected


@pytest.mark.parametrize(
    "args",
    [
        (bytes(158), 0, 0, 158, [{}], MISS_HIT, False),
        (bytes(158), 0, 0, 158, (), MISS_HIT, False),
        (bytes(158), 0, 0, 158, ({},), [b"m", b"h"], False),
        (bytes(158), 0, 0, 158, ({},), (b"m",), False),
        (bytes(158), 0, 0, 158, ({},), (b"m", "h"), False),
        (bytes(158), 0, 0, 158, ({},), (b"m", bytearray(b"h")), False),
        (bytes(158), 2, 0, 158, ({},), MISS_HIT, False),
        (bytes(158), None, 0, 158, ({},), MISS_HIT, False),
        (bytes(158), 0, -1, 158, ({},), MISS_HIT, False),
        (bytes(158), 0, 1, 158, ({},), MISS_HIT, False),
        (bytes(158), 0, 0, 159, ({},), MISS_HIT, False),
        (bytes(158), 0, 2**70, 158, ({},), MISS_HIT, False),
        (bytes(158), 0, 0, -(2**70), ({},), MISS_HIT, False),
        (bytes(158), 0, "0", 158, ({},), MISS_HIT, False),
        ("not a buffer" * 20, 0, 0, 158, ({},), MISS_HIT, False),
        (request_header(Command.EXIST, 0, b"k", b" ", 0), 0, 0, 158, ([], []), MISS_HIT, False),
        (request_header(Command.EXIST, 0, b"k", b" ", 0), 0, 0, 158, ({},), MISS_HIT),
    ],
)
def test_add_exists_twins_agree_on_bad_arguments_and_queue_nothing(
    framed_c: types.ModuleType, args: tuple[Any, ...]
) -> None:
    outcome = _exists_answer(framed_c.ReplyBuffer(), *args)
    assert outcome == _exists_answer(reference.ReplyBuffer(), *args), args
    assert outcome[1] == b"kept"


def test_add_exists_queues_nothing_when_a_later_key_fails(framed: types.ModuleType) -> None:
    keys = [f"chunk-{i}" for i in range(40)]
    shards: Any = list(_shards_holding(keys[:20], 4))
    bad = _shard.shard_index(keys[30], 4)
    shards[bad] = [keys[30]]  # not a dict: the lookup of a later key of the run fails
    burst = b"".join(lmproto.encode_request(Command.EXIST, k) for k in keys)
    queued = framed.ReplyBuffer()
    queued.add(b"kept")
    with pytest.raises(TypeError, match="tuple of dicts"):
        queued.add_exists(burst, 0, 0, len(burst), tuple(shards), MISS_HIT, False)
    assert queued.take() == b"kept"


def test_reply_buffer_frees_its_memory_on_release(framed: types.ModuleType) -> None:
    queued = framed.ReplyBuffer()
    empty = sys.getsizeof(queued)
    queued.add_framed(_frame_header(100_000), bytes(100_000))
    assert sys.getsizeof(queued) >= empty + 100_009
    assert len(queued.take()) == 100_009 and not len(queued)
    queued.release()
    assert sys.getsizeof(queued) == empty
    queued.add(b"again")
    assert queued.take() == b"again"  # usable after a release


@pytest.mark.parametrize("size", [2048, 2049, 4096, 4159, 16_376])
def test_reply_buffer_copies_whatever_its_source_lies_against_its_destination(
    framed: types.ModuleType, size: int
) -> None:
    """Every offset of the copy's destination past its source modulo 4 KiB, the window the C
    twin copies backwards (1-31 bytes) and around it, copies the object byte for byte. The
    C buffer is page-aligned and starts over after ``take``, so the object's destination is
    the header's length past a page boundary: a source that far minus ``ahead`` past one is
    ``ahead`` behind it."""
    body = bytes(range(256)) * 80 + b"tail"  # no two 64-byte blocks alike: a misplaced one shows
    with mmap.mmap(-1, 8192 + len(body)) as source:
        queued = framed.ReplyBuffer()
        for ahead in [*range(0, 40), 63, 64, 65, 4064, 4095]:
            header = _frame_header(size, b"")
            at = (len(header) - ahead) % 4096
            source[at : at + size] = body[:size]
            queued.add_framed(header, memoryview(source)[at : at + size])
            assert queued.take() == header + body[:size], ahead
            at = -ahead % 4096  # add: the data goes first
            source[at : at + size] = body[:size]
            queued.add(memoryview(source)[at : at + size])
            assert queued.take() == body[:size], ahead


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected stream sockets; the first is non-blocking, as a transport's is."""
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    with ours, peer:
        yield ours, peer


def test_send_nowait_sends_what_fits_and_says_how_much(
    framed: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer, send_nowait = *socket_pair, framed.send_nowait
    assert send_nowait(ours.fileno(), b"hello") == 5
    assert send_nowait(ours.fileno(), memoryview(b"xx, world")[2:]) == 7
    assert send_nowait(ours.fileno(), array.array("i", [1, 2])) == 8  # any buffer, in bytes
    assert send_nowait(ours.fileno(), b"") == 0
    assert peer.recv(100) == b"hello, world" + array.array("i", [1, 2]).tobytes()
    chunk, sent = bytes(1 << 16), []
    while not sent or sent[-1] == len(chunk):
        sent.append(send_nowait(ours.fileno(), chunk))
    assert send_nowait(ours.fileno(), chunk) == 0  # full: nothing more, and no waiting
    peer.setblocking(False)
    received = 0
    with contextlib.suppress(BlockingIOError):
        while True:
            received += len(peer.recv(1 << 20))
    assert received == sum(sent)


def test_send_nowait_to_a_peer_that_is_gone_sends_nothing(
    framed: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer, send_nowait = *socket_pair, framed.send_nowait
    peer.close()
    assert send_nowait(ours.fileno(), b"lost") == 0  # EPIPE, not SIGPIPE, and no exception


def test_reply_buffer_sends_what_the_socket_takes_and_keeps_the_rest(
    framed: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
    queued, data = framed.ReplyBuffer(), bytes(range(256)) * 16_384  # 4 MiB: more than the socket takes
    assert queued.send(ours.fileno()) == 0  # nothing queued, nothing left
    queued.add(data)
    left = queued.send(ours.fileno())
    assert 0 < left < len(data) and len(queued) == left  # the front went
    assert queued.send(ours.fileno()) == left and len(queued) == left  # full: kept
    received = bytearray()
    while len(received) < len(data):
        received += peer.recv(1 << 20)
        assert queued.send(ours.fileno()) == len(queued)
    assert received == data and not len(queued)
    queued.add(b"small")
    assert queued.send(ours.fileno()) == 0 and peer.recv(10) == b"small"  # all went
    queued.add(b"late")
    peer.close()
    assert queued.send(ours.fileno()) == 4 and queued.take() == b"late"  # a peer gone: kept too


def test_reply_buffer_send_twins_agree_on_bad_arguments(
    framed_c: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    for args in [("3",), (None,), (1.0,), (-1,), (2**31,), (2**70,), (), (socket_pair[0].fileno(), 0)]:
        c, python = framed_c.ReplyBuffer(), reference.ReplyBuffer()
        c.add(b"kept")
        python.add(b"kept")
        assert answer(c.send, *args) == answer(python.send, *args), args
        assert c.take() == python.take() == b"kept"


def test_send_nowait_twins_agree_on_bad_arguments(
    framed_c: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    fd = socket_pair[0].fileno()
    for args in [
        ("3", b"x"),
        (None, b"x"),
        (1.0, b"x"),
        (-1, b"x"),
        (2**31, b"x"),
        (2**70, b"x"),
        (-(2**70), b"x"),
        (fd, "text"),
        (fd, None),
        (fd,),
        (fd, b"x", 0),
    ]:
        assert answer(framed_c.send_nowait, *args) == answer(reference.send_nowait, *args), args


def test_recv_nowait_reads_what_is_there_says_when_nothing_is_and_sees_the_end(
    framed: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer, recv_nowait = *socket_pair, framed.recv_nowait
    into = bytearray(8)
    assert recv_nowait(ours.fileno(), into) == -1  # nothing yet, and no waiting
    peer.sendall(b"hello, world")
    assert recv_nowait(ours.fileno(), memoryview(into)[2:]) == 6 and into[2:] == b"hello,"
    assert recv_nowait(ours.fileno(), into) == 6 and into[:6] == b" world"
    numbers = array.array("i", [0, 0])  # any writable buffer, in bytes
    peer.sendall(bytes(range(8)))
    assert recv_nowait(ours.fileno(), numbers) == 8 and numbers.tobytes() == bytes(range(8))
    peer.shutdown(socket.SHUT_WR)
    assert recv_nowait(ours.fileno(), into) == 0  # the end of the stream
    assert recv_nowait(ours.fileno(), into) == 0


def test_recv_nowait_raises_for_a_reset_connection_and_a_closed_descriptor(
    framed: types.ModuleType,
) -> None:
    recv_nowait = framed.recv_nowait
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, socket.create_connection(listener.getsockname()) as client:
        accepted, _ = listener.accept()
        with accepted:
            accepted.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            accepted.close()  # linger 0: the client gets RST
            client.setblocking(False)
            with pytest.raises(ConnectionResetError):
                deadline = time.monotonic() + 10
                while recv_nowait(client.fileno(), bytearray(4)) == -1 and time.monotonic() < deadline:
                    time.sleep(0.01)
    closed = socket.socket()
    fd = closed.fileno()
    closed.close()
    with pytest.raises(OSError):
        recv_nowait(fd, bytearray(4))


def test_recv_nowait_twins_agree_on_bad_arguments(
    framed_c: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    fd = socket_pair[0].fileno()
    for args in [
        ("3", bytearray(1)),
        (None, bytearray(1)),
        (1.0, bytearray(1)),
        (-1, bytearray(1)),
        (2**31, bytearray(1)),
        (2**70, bytearray(1)),
        (fd, bytearray()),
        (fd, "text"),
        (fd, None),
        (fd,),
        (fd, bytearray(1), 0),
    ]:
        assert answer(framed_c.recv_nowait, *args) == answer(reference.recv_nowait, *args), args


def test_recv_nowait_refuses_a_read_only_buffer(
    framed: types.ModuleType, socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    with pytest.raises(BufferError):
        framed.recv_nowait(socket_pair[0].fileno(), b"read-only")


def _released(data: bytes) -> memoryview:
    view = memoryview(bytearray(data))
    view.release()
    return view


# Buffers the C twins read in place (lmproto/_inplace.h) where they took an export before,
# each with the same bytes as an exported buffer (array.array: never read in place) says.
IN_PLACE = [
    pytest.param(lambda data: memoryview(bytearray(data)), id="memoryview"),
    pytest.param(lambda data: memoryview(b"\xff" * 3 + data + b"\xff")[3:-1], id="view-slice"),
    pytest.param(lambda data: memoryview(data).toreadonly(), id="read-only-view"),
    pytest.param(lambda data: memoryview(bytearray(data)).cast("B", (2, len(data) // 2)), id="2-d-view"),
    pytest.param(lambda data: memoryview(array.array("h", data)), id="view-of-shorts"),
    pytest.param(bytearray, id="bytearray"),
    pytest.param(bytes, id="bytes"),
]
# ... and those they must refuse exactly as the export did.
REFUSED = [
    pytest.param(_released, ValueError, id="released-view"),
    pytest.param(lambda data: memoryview(bytes(2 * len(data)))[::2], BufferError, id="strided"),
]


def _outcome(call: Callable[..., Any], *args: Any) -> Any:
    try:
        return call(*args)
    except Exception as exc:  # the kind of refusal is what must agree
        return type(exc)


HEADER = lmproto.encode_request(Command.GET, "chunk-7", generation=Generation.V1)  # 186 bytes: even


@pytest.fixture(scope="module")
def c_twins(lookup_c: types.ModuleType, framed_c: types.ModuleType) -> tuple[types.ModuleType, ...]:
    """The C twins that read buffers in place (lmproto._lookup's too: one header, one rule)."""
    return lookup_c, framed_c


def _in_place_calls(
    c_twins: tuple[types.ModuleType, ...], wrap: Callable[[bytes], Any], fd: int
) -> list[Any]:
    """Every C call that reads a buffer in place, given ``wrap(data)``: what each answers."""
    lookup_c, framed_c = c_twins
    header = HEADER
    keys: list[str] = []
    outcomes: list[Any] = [
        _outcome(lookup_c.decode_lookup, wrap(header), Generation.V1),
        _outcome(lookup_c.decode_lookups, wrap(header), Generation.V1, 0, len(header)),
        (_outcome(lookup_c.decode_lookups_into, wrap(header), Generation.V1, 0, len(header), keys), keys),
        _outcome(framed_c.send_nowait, fd, wrap(header)),
    ]
    for add in ("add", "add_framed"):
        queued = framed_c.ReplyBuffer()
        args = (wrap(header),) if add == "add" else (_frame_header(100), wrap(header))
        outcomes.append((_outcome(getattr(queued, add), *args), queued.take()))
    return outcomes


@pytest.mark.parametrize("wrap", IN_PLACE)
def test_buffers_read_in_place_answer_as_exported_ones(
    c_twins: tuple[types.ModuleType, ...],
    wrap: Callable[[bytes], Any],
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = socket_pair
    framed_c = c_twins[1]
    exported = _in_place_calls(c_twins, lambda data: array.array("B", data), ours.fileno())
    assert _in_place_calls(c_twins, wrap, ours.fileno()) == exported
    assert exported[0] == (Command.GET, "chunk-7")
    assert exported[-1] == (None, _frame_header(100) + HEADER[:100])
    peer.setblocking(False)
    sent = peer.recv(1000)
    assert sent[: len(sent) // 2] == sent[len(sent) // 2 :]  # the same bytes went out both times
    into = wrap(bytes(8))
    if isinstance(into, bytes) or (isinstance(into, memoryview) and into.readonly):
        assert _outcome(framed_c.recv_nowait, ours.fileno(), into) is BufferError  # not writable
    else:
        peer.sendall(b"received")
        assert framed_c.recv_nowait(ours.fileno(), into) == 8 and bytes(into) == b"received"


@pytest.mark.parametrize(("wrap", "refusal"), REFUSED)
def test_buffers_read_in_place_refuse_what_an_export_refuses(
    c_twins: tuple[types.ModuleType, ...],
    wrap: Callable[[bytes], Any],
    refusal: type[Exception],
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    ours = socket_pair[0]
    outcomes = _in_place_calls(c_twins, wrap, ours.fileno())
    assert [*outcomes[:2], outcomes[3]] == [refusal] * 3
    assert [outcomes[2], *outcomes[4:]] == [(refusal, []), (refusal, b""), (refusal, b"")]  # nothing kept
    assert _outcome(c_twins[1].recv_nowait, ours.fileno(), wrap(bytes(8))) is refusal
