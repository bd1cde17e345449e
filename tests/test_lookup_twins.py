"""lmproto._lookup: its C twin (_lookup_c.c) gives the same answer and the same error as its
Python twin (_lookup_py.py, the reference) for every input, and both do what the reference says.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twins import FAST, KINDS, PIECES, RUN_HEADERS, TWINS, answer, as_buffer, chosen, request_header, twin

import lmproto
from lmproto import Command, Generation, _lookup, _native
from lmproto import _lookup_py as reference

FUNCTIONS = ["decode_lookup", "decode_lookups", "decode_lookups_into"]


@pytest.fixture(scope="module", params=TWINS)
def lookup(request: pytest.FixtureRequest) -> types.ModuleType:
    return twin("lmproto._lookup", request.param)


@pytest.fixture(scope="module")
def lookup_c() -> types.ModuleType:
    return twin("lmproto._lookup", "c")


@pytest.mark.parametrize("function", FUNCTIONS)
def test_the_selector_exports_the_twin_it_chose(function: str) -> None:
    assert _lookup.__name__ in _native.C_TWINS
    installed = getattr(_lookup, function)
    assert installed is getattr(chosen(_lookup), function) is getattr(lmproto, function)
    assert isinstance(installed, types.BuiltinFunctionType) == _lookup.COMPILED
    assert isinstance(getattr(reference, function), types.FunctionType)


def _same(c: types.ModuleType, *args: Any) -> None:
    assert answer(c.decode_lookup, *args) == answer(reference.decode_lookup, *args), args


@FAST
@given(
    st.lists(PIECES | st.binary(max_size=4), max_size=70),
    st.sampled_from([b" ", b"\x00"]),
    st.sampled_from([*Command, 0, -1, 2**31 - 1, -(2**31)]),
    st.sampled_from([0, 0, 1, -1, 4096, 2**31 - 1]),
    st.sampled_from([0, 1, Generation.V0, Generation.V1]),
    st.binary(max_size=5),
    KINDS,
)
def test_twins_agree_on_every_header(
    lookup_c: types.ModuleType,
    pieces: list[bytes],
    pad: bytes,
    command: int,
    length: int,
    generation: int,
    before: bytes,
    kind: Any,
) -> None:
    header = request_header(command, length, b"".join(pieces), pad, generation)
    data = before + header + b"tail"
    buf = as_buffer(kind, data)
    _same(lookup_c, buf, generation, len(before))
    if not before:
        _same(lookup_c, buf, generation)
    # every offset that leaves too few bytes, or none
    _same(lookup_c, buf, generation, len(data) - len(header) + 1)
    _same(lookup_c, buf, generation, len(data))
    _same(lookup_c, buf, generation, -1)


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
def test_twins_agree_on_bad_arguments(lookup_c: types.ModuleType, args: tuple[Any, ...]) -> None:
    _same(lookup_c, *args)


def _into(decode_into: Callable[..., int], *args: Any) -> tuple[Any, list[str]]:
    """What ``decode_lookups_into`` answers, and what the list it was given then holds."""
    keys = ["stale", "keys"]
    return answer(decode_into, *args, keys), keys


def _same_runs(c: types.ModuleType, *args: Any) -> None:
    runs = answer(c.decode_lookups, *args)
    assert runs == answer(reference.decode_lookups, *args), args
    into = _into(c.decode_lookups_into, *args)
    assert into == _into(reference.decode_lookups_into, *args), args
    if isinstance(runs, tuple) and len(runs) == 2 and isinstance(runs[1], tuple):
        assert into == (runs[0], list(runs[1]))  # the same run, in the list
    else:
        assert into == (runs, ["stale", "keys"])  # the same error; the list as it was


@FAST
@given(
    st.lists(RUN_HEADERS, min_size=1, max_size=12),
    st.sampled_from([0, 1, Generation.V0, Generation.V1]),
    st.binary(max_size=5),
    st.integers(0, 200),
    KINDS,
)
def test_run_twins_agree_on_every_burst(
    lookup_c: types.ModuleType,
    headers: list[tuple[int, int, bytes, bytes]],
    generation: int,
    before: bytes,
    cut: int,
    kind: Any,
) -> None:
    burst = b"".join(request_header(c, n, key, pad, generation) for c, n, key, pad in headers)
    buf = as_buffer(kind, before + burst + b"tail")
    start, end = len(before), len(before) + len(burst)
    _same_runs(lookup_c, buf, generation, start, end)
    _same_runs(lookup_c, buf, generation, start, end - cut)  # the last header cut short, or several
    _same_runs(lookup_c, buf, generation, start, len(buf))
    _same_runs(lookup_c, buf, generation, start + 1, end)
    command, keys = lookup_c.decode_lookups(buf, generation, start, end)
    size = lmproto.REQUEST_SIZE[Generation(generation)]
    expected = []  # each key is what decode_lookup answers for its header
    for at in range(start, start + size * len(keys), size):
        assert lookup_c.decode_lookup(buf, generation, at)[0] == command
        expected.append(lookup_c.decode_lookup(buf, generation, at)[1])
    assert list(keys) == expected
    assert all(expected)


def test_a_long_run_comes_back_in_pieces_of_run_max(lookup: types.ModuleType) -> None:
    assert lookup.RUN_MAX == reference.RUN_MAX
    size = lmproto.REQUEST_SIZE[Generation.V1]
    burst = b"".join(
        lmproto.encode_request(Command.EXIST, f"chunk-{i}", generation=Generation.V1) for i in range(150)
    )
    command, keys = lookup.decode_lookups(burst, Generation.V1, 0, len(burst))
    assert (command, keys) == (Command.EXIST, tuple(f"chunk-{i}" for i in range(lookup.RUN_MAX)))
    command, keys = lookup.decode_lookups(burst, Generation.V1, 128 * size, len(burst))
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
def test_run_twins_agree_on_bad_arguments(lookup_c: types.ModuleType, args: tuple[Any, ...]) -> None:
    _same_runs(lookup_c, *args)


@pytest.mark.parametrize("keys", [("a tuple",), None, "a str", type("AList", (list,), {})()])
def test_decode_lookups_into_takes_exactly_a_list(lookup: types.ModuleType, keys: Any) -> None:
    burst = lmproto.encode_request(Command.EXIST, "chunk", generation=Generation.V1)
    with pytest.raises(TypeError):
        lookup.decode_lookups_into(burst, Generation.V1, 0, len(burst), keys)


def test_decode_lookups_into_refills_one_list_call_after_call(lookup: types.ModuleType) -> None:
    size = lmproto.REQUEST_SIZE[Generation.V1]
    burst = b"".join(
        lmproto.encode_request(Command.GET, f"chunk-{i}", generation=Generation.V1) for i in range(100)
    ) + lmproto.encode_request(Command.EXIST, "last", generation=Generation.V1)
    decode_into = lookup.decode_lookups_into
    keys: list[str] = []
    assert decode_into(burst, Generation.V1, 0, len(burst), keys) == Command.GET
    assert keys == [f"chunk-{i}" for i in range(lookup.RUN_MAX)]  # a longer list first
    assert decode_into(burst, Generation.V1, 98 * size, len(burst), keys) == Command.GET
    assert keys == ["chunk-98", "chunk-99"]  # then a shorter one: nothing of the first left
    assert decode_into(burst, Generation.V1, 100 * size, len(burst), keys) == Command.EXIST
    assert keys == ["last"]
    put = lmproto.encode_request(Command.PUT, "body", length=4, generation=Generation.V1)
    assert decode_into(put, Generation.V1, 0, len(put), keys) == Command.PUT
    assert keys == []
