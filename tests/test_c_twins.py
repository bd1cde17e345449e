"""The hand-written C modules (HAND_WRITTEN_C: lmproto/_lookup.c, lmserver/_framed.c,
lmserver/_shard.c) give the same answer and the same error as their Python twins, the
reference, for every input.

In a pure install, or with LMSERVER_PURE=1, both sides are the Python twin and this file checks
nothing new; CI's compiled run (LMSERVER_EXPECT_COMPILED=1) is the one that compares them.
"""

from __future__ import annotations

import array
import contextlib
import importlib.util
import mmap
import socket
import struct
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_lmproto_properties import ASCII_EDGES, KEY_PIECES

import lmproto
from lmproto import Command, Generation, _lookup, _native
from lmserver import _framed, _shard

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _python_twin(module: types.ModuleType) -> types.ModuleType:
    """The module's .py twin loaded from its file under another name, whatever ``module`` is."""
    package = importlib.import_module(module.__name__.rpartition(".")[0])
    source = Path(package.__file__ or "").parent / (module.__name__.rpartition(".")[2] + ".py")
    spec = importlib.util.spec_from_file_location(module.__name__ + "_reference", source)
    assert spec is not None and spec.loader is not None
    twin = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(twin)
    return twin


reference = _python_twin(_lookup)
shard_reference = _python_twin(_shard)
framed_reference = _python_twin(_framed)


def _answer(decode: Callable[..., Any], *args: Any) -> Any:
    try:
        return decode(*args)
    except (ValueError, TypeError) as exc:
        return type(exc), str(exc) if isinstance(exc, ValueError) else ""


def _same(*args: Any) -> None:
    assert _answer(_lookup.decode_lookup, *args) == _answer(reference.decode_lookup, *args), args


@pytest.mark.parametrize(
    ("module", "function"),
    [
        (_lookup, "decode_lookup"),
        (_lookup, "decode_lookups"),
        (_lookup, "decode_lookups_into"),
        (_framed, "send_nowait"),
        (_shard, "shard_index"),
    ],
)
def test_the_installed_twin_is_what_the_build_says(module: types.ModuleType, function: str) -> None:
    assert module.__name__ in _native.HAND_WRITTEN_C
    installed, twin = getattr(module, function), getattr(_python_twin(module), function)
    assert isinstance(installed, types.BuiltinFunctionType) == _native.is_compiled(module)
    assert isinstance(twin, types.FunctionType)
    assert lmproto.decode_lookup is _lookup.decode_lookup
    assert lmproto.decode_lookups is _lookup.decode_lookups
    assert lmproto.decode_lookups_into is _lookup.decode_lookups_into


def test_the_installed_reply_buffer_is_what_the_build_says() -> None:
    assert isinstance(framed_reference.ReplyBuffer.add, types.FunctionType)
    assert isinstance(_framed.ReplyBuffer.add, types.FunctionType) != _native.is_compiled(_framed)


def test_the_installed_shard_lock_is_what_the_build_says() -> None:
    assert shard_reference.ShardLock is threading.Lock
    assert (_shard.ShardLock is threading.Lock) != _native.is_compiled(_shard)


PIECES = KEY_PIECES | ASCII_EDGES | st.sampled_from([b"@", b"\x85"])


def _header(command: int, length: int, key_field: bytes, pad: bytes, generation: int) -> bytes:
    """A request header with these raw numbers and key field (cut or padded to KEY_SIZE)."""
    raw = key_field[: lmproto.KEY_SIZE].ljust(lmproto.KEY_SIZE, pad)
    header = lmproto.encode_request(Command.EXIST, "k", generation=Generation(generation))
    numbers = command.to_bytes(4, "little", signed=True) + length.to_bytes(4, "little", signed=True)
    return numbers + header[8 : -lmproto.KEY_SIZE] + raw


def _as(kind: Any, data: bytes) -> Any:
    if kind != "mmap":
        return kind(data)
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


@FAST
@given(
    st.lists(PIECES | st.binary(max_size=4), max_size=70),
    st.sampled_from([b" ", b"\x00"]),
    st.sampled_from([*Command, 0, -1, 2**31 - 1, -(2**31)]),
    st.sampled_from([0, 0, 1, -1, 4096, 2**31 - 1]),
    st.sampled_from([0, 1, Generation.V0, Generation.V1]),
    st.binary(max_size=5),
    st.sampled_from([bytes, bytearray, memoryview, "mmap"]),
)
def test_twins_agree_on_every_header(
    pieces: list[bytes], pad: bytes, command: int, length: int, generation: int, before: bytes, kind: Any
) -> None:
    header = _header(command, length, b"".join(pieces), pad, generation)
    data = before + header + b"tail"
    buf = _as(kind, data)
    _same(buf, generation, len(before))
    if not before:
        _same(buf, generation)
    # every offset that leaves too few bytes, or none
    _same(buf, generation, len(data) - len(header) + 1)
    _same(buf, generation, len(data))
    _same(buf, generation, -1)


@pytest.mark.parametrize(
    "args",
    [
        (bytes(186), 2),
        (bytes(186), -1),
        (bytes(186), 2**70),
        (bytes(186), "1"),
        (bytes(186), None),
        (bytes(186), 0, 2**70),
        (bytes(186), 0, -(2**70)),
        (bytes(186), 0, "0"),
        (bytes(157), 0),
        (bytes(185), 1),
        (bytes(158), 0),
        (bytes(186), 1),
        ("not a buffer" * 20, 0),
        (bytes(186),),
        (bytes(186), 0, 0, 0),
    ],
)
def test_twins_agree_on_bad_arguments(args: tuple[Any, ...]) -> None:
    _same(*args)


def _into(decode_into: Callable[..., int], *args: Any) -> tuple[Any, list[str]]:
    """What ``decode_lookups_into`` answers, and what the list it was given then holds."""
    keys = ["stale", "keys"]
    return _answer(decode_into, *args, keys), keys


def _same_runs(*args: Any) -> None:
    answer = _answer(_lookup.decode_lookups, *args)
    assert answer == _answer(reference.decode_lookups, *args), args
    into = _into(_lookup.decode_lookups_into, *args)
    assert into == _into(reference.decode_lookups_into, *args), args
    if isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[1], tuple):
        assert into == (answer[0], list(answer[1]))  # the same run, in the list
    else:
        assert into == (answer, ["stale", "keys"])  # the same error; the list as it was


# Headers as a burst holds them: mostly lookups with good keys, some that end a run.
RUN_HEADERS = st.tuples(
    st.sampled_from([Command.EXIST, Command.EXIST, Command.GET, Command.PUT, Command.HEALTH, 0, -1]),
    st.sampled_from([0, 0, 0, 1, -1]),
    st.lists(PIECES, max_size=6).map(b"".join) | st.sampled_from([b"chunk-1", b"k", b""]),
    st.sampled_from([b" ", b"\x00"]),
)


@FAST
@given(
    st.lists(RUN_HEADERS, min_size=1, max_size=12),
    st.sampled_from([0, 1, Generation.V0, Generation.V1]),
    st.binary(max_size=5),
    st.integers(0, 200),
    st.sampled_from([bytes, bytearray, memoryview, "mmap"]),
)
def test_run_twins_agree_on_every_burst(
    headers: list[tuple[int, int, bytes, bytes]], generation: int, before: bytes, cut: int, kind: Any
) -> None:
    burst = b"".join(_header(c, n, key, pad, generation) for c, n, key, pad in headers)
    buf = _as(kind, before + burst + b"tail")
    start, end = len(before), len(before) + len(burst)
    _same_runs(buf, generation, start, end)
    _same_runs(buf, generation, start, end - cut)  # the last header cut short, or several
    _same_runs(buf, generation, start, len(buf))
    _same_runs(buf, generation, start + 1, end)
    command, keys = _lookup.decode_lookups(buf, generation, start, end)
    size = lmproto.REQUEST_SIZE[Generation(generation)]
    expected = []  # each key is what decode_lookup answers for its header
    for at in range(start, start + size * len(keys), size):
        assert _lookup.decode_lookup(buf, generation, at)[0] == command
        expected.append(_lookup.decode_lookup(buf, generation, at)[1])
    assert list(keys) == expected
    assert all(expected)


def test_a_long_run_comes_back_in_pieces_of_run_max() -> None:
    assert _lookup.RUN_MAX == reference.RUN_MAX
    size = lmproto.REQUEST_SIZE[Generation.V1]
    burst = b"".join(
        lmproto.encode_request(Command.EXIST, f"chunk-{i}", generation=Generation.V1) for i in range(150)
    )
    for decode in (_lookup.decode_lookups, reference.decode_lookups):
        command, keys = decode(burst, Generation.V1, 0, len(burst))
        assert (command, keys) == (Command.EXIST, tuple(f"chunk-{i}" for i in range(_lookup.RUN_MAX)))
        command, keys = decode(burst, Generation.V1, 128 * size, len(burst))
        assert keys == tuple(f"chunk-{i}" for i in range(128, 150))


@pytest.mark.parametrize(
    "args",
    [
        (bytes(186), 2, 0, 186),
        (bytes(186), None, 0, 186),
        (bytes(186), 1, -1, 186),
        (bytes(186), 1, 1, 186),
        (bytes(186), 1, 0, 185),
        (bytes(186), 1, 0, 187),
        (bytes(372), 1, 186, 186),
        (bytes(186), 1, 2**70, 186),
        (bytes(186), 1, -(2**70), 186),
        (bytes(186), 1, 0, 2**70),
        (bytes(186), 1, 0, -(2**70)),
        (bytes(186), 1, "0", 186),
        (bytes(186), 1, 0, "186"),
        (bytes(158), 0, 0, 158),
        (bytes(186), 1, 0, 186),
        ("not a buffer" * 20, 0, 0, 158),
        (bytes(186), 1, 0),
        (bytes(186), 1, 0, 186, 0),
    ],
)
def test_run_twins_agree_on_bad_arguments(args: tuple[Any, ...]) -> None:
    _same_runs(*args)


@pytest.mark.parametrize("keys", [("a tuple",), None, "a str", type("AList", (list,), {})()])
def test_decode_lookups_into_takes_exactly_a_list(keys: Any) -> None:
    burst = lmproto.encode_request(Command.EXIST, "chunk", generation=Generation.V1)
    for decode_into in (_lookup.decode_lookups_into, reference.decode_lookups_into):
        with pytest.raises(TypeError):
            decode_into(burst, Generation.V1, 0, len(burst), keys)


def test_decode_lookups_into_refills_one_list_call_after_call() -> None:
    size = lmproto.REQUEST_SIZE[Generation.V1]
    burst = b"".join(
        lmproto.encode_request(Command.GET, f"chunk-{i}", generation=Generation.V1) for i in range(100)
    ) + lmproto.encode_request(Command.EXIST, "last", generation=Generation.V1)
    for decode_into in (_lookup.decode_lookups_into, reference.decode_lookups_into):
        keys: list[str] = []
        assert decode_into(burst, Generation.V1, 0, len(burst), keys) == Command.GET
        assert keys == [f"chunk-{i}" for i in range(_lookup.RUN_MAX)]  # a longer list first
        assert decode_into(burst, Generation.V1, 98 * size, len(burst), keys) == Command.GET
        assert keys == ["chunk-98", "chunk-99"]  # then a shorter one: nothing of the first left
        assert decode_into(burst, Generation.V1, 100 * size, len(burst), keys) == Command.EXIST
        assert keys == ["last"]
        put = lmproto.encode_request(Command.PUT, "body", length=4, generation=Generation.V1)
        assert decode_into(put, Generation.V1, 0, len(put), keys) == Command.PUT
        assert keys == []


# -- lmserver._shard


def _same_shard(*args: Any) -> None:
    def answer(shard_index: Callable[..., int]) -> Any:
        try:
            return shard_index(*args)
        except (ValueError, TypeError, OverflowError) as exc:
            return type(exc), str(exc) if isinstance(exc, ValueError) else ""

    assert answer(_shard.shard_index) == answer(shard_reference.shard_index), args


@FAST
@given(st.text(max_size=60), st.integers(1, 64) | st.sampled_from([1, 16, 2**31, 2**62, 2**63 - 1]))
def test_shard_twins_agree(key: str, shards: int) -> None:
    _same_shard(key, shards)
    assert 0 <= _shard.shard_index(key, shards) < shards


@pytest.mark.parametrize(
    "args",
    [
        ("k", 0),
        ("k", -3),
        ("k", 2**64),
        ("k", -(2**64)),
        ("k", "4"),
        (["unhashable"], 4),
        ("k",),
        ("k", 4, 5),
    ],
)
def test_shard_twins_agree_on_bad_arguments(args: tuple[Any, ...]) -> None:
    _same_shard(*args)


LOCKS = pytest.mark.parametrize(
    "lock_type", [_shard.ShardLock, shard_reference.ShardLock], ids=["installed", "twin"]
)


@LOCKS
def test_shard_lock_twins_agree(lock_type: Callable[[], Any]) -> None:
    lock = lock_type()
    assert not lock.locked()
    assert lock.acquire() is True
    assert lock.locked()
    assert lock.release() is None
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="release unlocked lock"):
        lock.release()
    with pytest.raises(KeyError), lock:
        assert lock.locked()
        raise KeyError("the with block's exception goes through, and the lock is released")
    assert not lock.locked()
    with pytest.raises(TypeError):
        lock_type(1)  # type: ignore[call-arg]
    held = lock_type()
    held.acquire()
    del held  # a held lock may be dropped, as a threading.Lock


@pytest.fixture
def fast_switching() -> Iterator[None]:
    """Threads switch every microsecond: a critical section without mutual exclusion loses updates."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


@LOCKS
def test_shard_lock_excludes_and_waits_without_the_gil(
    lock_type: Callable[[], Any], fast_switching: None
) -> None:
    lock, count, rounds = lock_type(), [0], 2000

    def add() -> None:
        for _ in range(rounds):
            with lock:
                seen = count[0]
                threading.Event().wait(0)  # releases the GIL inside the critical section
                count[0] = seen + 1

    workers = [threading.Thread(target=add) for _ in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
    assert not any(worker.is_alive() for worker in workers), "a waiter holds the GIL: deadlock"
    assert count[0] == 4 * rounds

    # A waiter blocks until the holder (which needs the GIL to get there) releases.
    got = threading.Event()
    lock.acquire()

    def wait_for_it() -> None:
        lock.acquire()
        got.set()
        lock.release()

    waiter = threading.Thread(target=wait_for_it)
    waiter.start()
    assert not got.wait(0.2)
    lock.release()
    assert got.wait(60)
    waiter.join(60)


# -- lmserver._framed


REPLY_BUFFERS = pytest.mark.parametrize(
    "reply_buffer", [_framed.ReplyBuffer, framed_reference.ReplyBuffer], ids=["installed", "twin"]
)
KINDS = st.sampled_from([bytes, bytearray, memoryview, "mmap"])


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
        args = [_as(args[1], args[0]) if args[0] or args[1] != "mmap" else b""]  # no empty mmap
    elif name == "add_framed":
        header, data, kind = args
        args = [header, _as(kind, data) if data or kind != "mmap" else b""]
    answer = _answer(getattr(reply_buffer, name), *args)
    return answer, len(reply_buffer)


@FAST
@given(st.lists(BUFFER_OPERATIONS, max_size=12))
def test_reply_buffer_twins_agree(operations: list[tuple[Any, ...]]) -> None:
    installed, twin = _framed.ReplyBuffer(), framed_reference.ReplyBuffer()
    expected = b""
    for operation in operations:
        answer = _apply(installed, operation)
        assert answer == _apply(twin, operation), operation
        name, *args = operation
        if name == "add":
            expected += args[0]
        elif name == "add_framed":
            announced = _announced(args[0])
            if announced is not None and 0 <= announced <= len(args[1]):
                expected += args[0] + args[1][:announced]
        elif name == "take":
            assert answer[0] == expected
            expected = b""
        elif name == "release":
            expected = b""
        assert answer[1] == len(expected)
    assert installed.take() == twin.take() == expected


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
def test_reply_buffer_twins_agree_on_bad_arguments_and_keep_what_they_held(args: tuple[Any, ...]) -> None:
    name, *rest = args
    installed, twin = _framed.ReplyBuffer(), framed_reference.ReplyBuffer()
    for queued in (installed, twin):
        queued.add(b"kept")
    assert _answer(getattr(installed, name), *rest) == _answer(getattr(twin, name), *rest), args
    assert installed.take() == twin.take() == b"kept"  # nothing half-added


def test_reply_buffer_twins_agree_on_constructor_arguments() -> None:
    for args in [(1,), (b"",), (None,)]:
        assert _answer(_framed.ReplyBuffer, *args) == _answer(framed_reference.ReplyBuffer, *args)


MISS_HIT = (b"miss", b"HIT!")


def _shards_holding(keys: list[str], count: int) -> tuple[dict[str, object], ...]:
    shards: tuple[dict[str, object], ...] = tuple({} for _ in range(count))
    for key in keys:
        shards[_shard.shard_index(key, count)][key] = None
    return shards


def _exists_answer(reply_buffer: Any, *args: Any) -> Any:
    """add_exists's answer (or error) and what the buffer holds after: it had b"kept"."""
    reply_buffer.add(b"kept")
    return _answer(reply_buffer.add_exists, *args), reply_buffer.take()


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
    headers: list[tuple[int, int, bytes, bytes]],
    generation: int,
    count: int,
    held: list[bool],
    stop_at_miss: bool,
    cut: int,
    kind: Any,
) -> None:
    burst = b"".join(_header(c, n, key, pad, generation) for c, n, key, pad in headers)
    buf = _as(kind, burst + b"tail")
    size = lmproto.REQUEST_SIZE[Generation(generation)]
    keys = [_lookup.decode_lookup(buf, generation, at)[1] for at in range(0, len(burst), size)]
    shards = _shards_holding([k for k, h in zip(keys, held, strict=False) if k and h], count)
    for end in (len(burst), len(burst) - cut, len(buf)):
        args = (buf, generation, 0, end, shards, MISS_HIT, stop_at_miss)
        answer, queued = _exists_answer(_framed.ReplyBuffer(), *args)
        assert (answer, queued) == _exists_answer(framed_reference.ReplyBuffer(), *args), args
        if isinstance(answer, tuple) and isinstance(answer[0], type):
            continue  # an error (end before the first whole header): checked alike above
        expected, hits = b"kept", 0  # the run as decode_lookup and shard_index read it
        for at in range(0, end - size + 1, size):
            command, key = _lookup.decode_lookup(buf, generation, at)
            found = bool(key) and key in shards[_shard.shard_index(key, count)]
            if command != Command.EXIST or not key or (stop_at_miss and not found):
                break
            expected += MISS_HIT[found]
            hits += found
        assert answer == ((len(expected) - 4) // 4, hits)
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
        (_header(Command.EXIST, 0, b"k", b" ", 0), 0, 0, 158, ([], []), MISS_HIT, False),
        (_header(Command.EXIST, 0, b"k", b" ", 0), 0, 0, 158, ({},), MISS_HIT),
    ],
)
def test_add_exists_twins_agree_on_bad_arguments_and_queue_nothing(args: tuple[Any, ...]) -> None:
    answer = _exists_answer(_framed.ReplyBuffer(), *args)
    assert answer == _exists_answer(framed_reference.ReplyBuffer(), *args), args
    assert answer[1] == b"kept"


@REPLY_BUFFERS
def test_add_exists_queues_nothing_when_a_later_key_fails(reply_buffer: Callable[[], Any]) -> None:
    keys = [f"chunk-{i}" for i in range(40)]
    shards: Any = list(_shards_holding(keys[:20], 4))
    bad = _shard.shard_index(keys[30], 4)
    shards[bad] = [keys[30]]  # not a dict: the lookup of a later key of the run fails
    burst = b"".join(lmproto.encode_request(Command.EXIST, k) for k in keys)
    queued = reply_buffer()
    queued.add(b"kept")
    with pytest.raises(TypeError, match="tuple of dicts"):
        queued.add_exists(burst, 0, 0, len(burst), tuple(shards), MISS_HIT, False)
    assert queued.take() == b"kept"


@REPLY_BUFFERS
def test_reply_buffer_frees_its_memory_on_release(reply_buffer: Callable[[], Any]) -> None:
    queued = reply_buffer()
    empty = sys.getsizeof(queued)
    queued.add_framed(_frame_header(100_000), bytes(100_000))
    assert sys.getsizeof(queued) >= empty + 100_009
    assert len(queued.take()) == 100_009 and not len(queued)
    queued.release()
    assert sys.getsizeof(queued) == empty
    queued.add(b"again")
    assert queued.take() == b"again"  # usable after a release


@REPLY_BUFFERS
@pytest.mark.parametrize("size", [2048, 2049, 4096, 4159, 16_376])
def test_reply_buffer_copies_whatever_its_source_lies_against_its_destination(
    reply_buffer: Callable[[], Any], size: int
) -> None:
    """Every offset of the copy's destination past its source modulo 4 KiB, the window the C
    twin copies backwards (1-31 bytes) and around it, copies the object byte for byte. The
    C buffer is page-aligned and starts over after ``take``, so the object's destination is
    the header's length past a page boundary: a source that far minus ``ahead`` past one is
    ``ahead`` behind it."""
    body = bytes(range(256)) * 80 + b"tail"  # no two 64-byte blocks alike: a misplaced one shows
    with mmap.mmap(-1, 8192 + len(body)) as source:
        queued = reply_buffer()
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


SENDERS = pytest.mark.parametrize(
    "send_nowait", [_framed.send_nowait, framed_reference.send_nowait], ids=["installed", "twin"]
)


@pytest.fixture
def socket_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected stream sockets; the first is non-blocking, as a transport's is."""
    ours, peer = socket.socketpair()
    ours.setblocking(False)
    with ours, peer:
        yield ours, peer


@SENDERS
def test_send_nowait_sends_what_fits_and_says_how_much(
    send_nowait: Callable[[int, Any], int], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
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


@SENDERS
def test_send_nowait_to_a_peer_that_is_gone_sends_nothing(
    send_nowait: Callable[[int, Any], int], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
    peer.close()
    assert send_nowait(ours.fileno(), b"lost") == 0  # EPIPE, not SIGPIPE, and no exception


@REPLY_BUFFERS
def test_reply_buffer_sends_what_the_socket_takes_and_keeps_the_rest(
    reply_buffer: Callable[[], Any], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
    queued, data = reply_buffer(), bytes(range(256)) * 16_384  # 4 MiB: more than the socket takes
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
    socket_pair: tuple[socket.socket, socket.socket],
) -> None:
    for args in [("3",), (None,), (1.0,), (-1,), (2**31,), (2**70,), (), (socket_pair[0].fileno(), 0)]:
        installed, twin = _framed.ReplyBuffer(), framed_reference.ReplyBuffer()
        installed.add(b"kept")
        twin.add(b"kept")
        assert _answer(installed.send, *args) == _answer(twin.send, *args), args
        assert installed.take() == twin.take() == b"kept"


def test_send_nowait_twins_agree_on_bad_arguments(socket_pair: tuple[socket.socket, socket.socket]) -> None:
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
        assert _answer(_framed.send_nowait, *args) == _answer(framed_reference.send_nowait, *args), args


RECEIVERS = pytest.mark.parametrize(
    "recv_nowait", [_framed.recv_nowait, framed_reference.recv_nowait], ids=["installed", "twin"]
)


@RECEIVERS
def test_recv_nowait_reads_what_is_there_says_when_nothing_is_and_sees_the_end(
    recv_nowait: Callable[[int, Any], int], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
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


@RECEIVERS
def test_recv_nowait_raises_for_a_reset_connection_and_a_closed_descriptor(
    recv_nowait: Callable[[int, Any], int],
) -> None:
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


def test_recv_nowait_twins_agree_on_bad_arguments(socket_pair: tuple[socket.socket, socket.socket]) -> None:
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
        assert _answer(_framed.recv_nowait, *args) == _answer(framed_reference.recv_nowait, *args), args
    for receive in (_framed.recv_nowait, framed_reference.recv_nowait):
        with pytest.raises(BufferError):
            receive(fd, b"read-only")


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
IN_PLACE_IS_C = pytest.mark.skipif(
    not (_native.is_compiled(_lookup) and _native.is_compiled(_framed)),
    reason="reading in place is the C twins' (the pure build has none)",
)


def _in_place_calls(wrap: Callable[[bytes], Any], fd: int) -> list[Any]:
    """Every C call that reads a buffer in place, given ``wrap(data)``: what each answers."""
    header = HEADER
    keys: list[str] = []
    outcomes: list[Any] = [
        _outcome(_lookup.decode_lookup, wrap(header), Generation.V1),
        _outcome(_lookup.decode_lookups, wrap(header), Generation.V1, 0, len(header)),
        (_outcome(_lookup.decode_lookups_into, wrap(header), Generation.V1, 0, len(header), keys), keys),
        _outcome(_framed.send_nowait, fd, wrap(header)),
    ]
    for add in ("add", "add_framed"):
        queued = _framed.ReplyBuffer()
        args = (wrap(header),) if add == "add" else (_frame_header(100), wrap(header))
        outcomes.append((_outcome(getattr(queued, add), *args), queued.take()))
    return outcomes


@IN_PLACE_IS_C
@pytest.mark.parametrize("wrap", IN_PLACE)
def test_buffers_read_in_place_answer_as_exported_ones(
    wrap: Callable[[bytes], Any], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours, peer = socket_pair
    exported = _in_place_calls(lambda data: array.array("B", data), ours.fileno())
    assert _in_place_calls(wrap, ours.fileno()) == exported
    assert exported[0] == (Command.GET, "chunk-7")
    assert exported[-1] == (None, _frame_header(100) + HEADER[:100])
    peer.setblocking(False)
    sent = peer.recv(1000)
    assert sent[: len(sent) // 2] == sent[len(sent) // 2 :]  # the same bytes went out both times
    into = wrap(bytes(8))
    if isinstance(into, bytes) or (isinstance(into, memoryview) and into.readonly):
        assert _outcome(_framed.recv_nowait, ours.fileno(), into) is BufferError  # not writable
    else:
        peer.sendall(b"received")
        assert _framed.recv_nowait(ours.fileno(), into) == 8 and bytes(into) == b"received"


@IN_PLACE_IS_C
@pytest.mark.parametrize(("wrap", "refusal"), REFUSED)
def test_buffers_read_in_place_refuse_what_an_export_refuses(
    wrap: Callable[[bytes], Any], refusal: type[Exception], socket_pair: tuple[socket.socket, socket.socket]
) -> None:
    ours = socket_pair[0]
    outcomes = _in_place_calls(wrap, ours.fileno())
    assert [*outcomes[:2], outcomes[3]] == [refusal] * 3
    assert [outcomes[2], *outcomes[4:]] == [(refusal, []), (refusal, b""), (refusal, b"")]  # nothing kept
    assert _outcome(_framed.recv_nowait, ours.fileno(), wrap(bytes(8))) is refusal
