"""The two twins of a selector module (docs/building.md), for the tests that run each twin or
compare them: tests/test_lookup_twins.py, test_shard_twins.py, test_framed_twins.py.

Both twins are tested in one run, as aiohttp tests its parsers: a fixture parametrized over
``TWINS`` gives each twin to a test of behaviour, and a test that compares the C twin with the
Python one (the reference) takes the C twin alone. The C twin is skipped where the selector
would not import it (a pure build, ``LMSERVER_PURE=1``), and fails the test instead where
``LMSERVER_EXPECT_COMPILED=1`` says the build made it.
"""

from __future__ import annotations

import importlib
import mmap
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from test_lmproto_properties import ASCII_EDGES, KEY_PIECES

import lmproto
from lmproto import Command, Generation, _native

TWINS = ("py", "c")

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def twin(selector: str, kind: str) -> ModuleType:
    """The Python (``"py"``) or the C (``"c"``) twin of the selector module ``selector``."""
    if kind == "c" and not _native.use_c_twin(selector):
        if _native.pure_requested():
            pytest.skip(f"{_native.PURE_ENV}=1: {selector}_c is not used")
        if os.environ.get("LMSERVER_EXPECT_COMPILED", "") not in ("", "0"):
            pytest.fail(f"LMSERVER_EXPECT_COMPILED=1, but {selector}_c was not built")
        pytest.skip(f"{selector}_c was not built (a pure build)")
    return importlib.import_module(f"{selector}_{kind}")


def chosen(selector: ModuleType) -> ModuleType:
    """The twin the selector module imported: its C twin if it says it runs compiled."""
    return importlib.import_module(f"{selector.__name__}_{'c' if selector.COMPILED else 'py'}")


def answer(call: Callable[..., Any], *args: Any) -> Any:
    """What ``call(*args)`` returns, or the type (and a ValueError's text) of what it raises."""
    try:
        return call(*args)
    except (ValueError, TypeError) as exc:
        return type(exc), str(exc) if isinstance(exc, ValueError) else ""


PIECES = KEY_PIECES | ASCII_EDGES | st.sampled_from([b"@", b"\x85"])
KINDS = st.sampled_from([bytes, bytearray, memoryview, "mmap"])


def request_header(command: int, length: int, key_field: bytes, pad: bytes, generation: int) -> bytes:
    """A request header with these raw numbers and key field (cut or padded to KEY_SIZE)."""
    raw = key_field[: lmproto.KEY_SIZE].ljust(lmproto.KEY_SIZE, pad)
    header = lmproto.encode_request(Command.EXIST, "k", generation=Generation(generation))
    numbers = command.to_bytes(4, "little", signed=True) + length.to_bytes(4, "little", signed=True)
    return numbers + header[8 : -lmproto.KEY_SIZE] + raw


def as_buffer(kind: Any, data: bytes) -> Any:
    """``data`` in a buffer of ``kind`` (one of ``KINDS``)."""
    if kind != "mmap":
        return kind(data)
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    return buf


# Headers as a burst holds them: mostly lookups with good keys, some that end a run.
RUN_HEADERS = st.tuples(
    st.sampled_from([Command.EXIST, Command.EXIST, Command.GET, Command.PUT, Command.HEALTH, 0, -1]),
    st.sampled_from([0, 0, 0, 1, -1]),
    st.lists(PIECES, max_size=6).map(b"".join) | st.sampled_from([b"chunk-1", b"k", b""]),
    st.sampled_from([b" ", b"\x00"]),
)
