"""lmserver._shard: its C twin (_shard_c.c) gives the same answer and the same error as its
Python twin (_shard_py.py, the reference) for every input, and both locks do what a lock does.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from twins import FAST, TWINS, chosen, twin

from lmserver import _native, _shard
from lmserver import _shard_py as reference


@pytest.fixture(scope="module", params=TWINS)
def shard(request: pytest.FixtureRequest) -> types.ModuleType:
    return twin("lmserver._shard", request.param)


@pytest.fixture(scope="module")
def shard_c() -> types.ModuleType:
    return twin("lmserver._shard", "c")


def test_the_selector_exports_the_twin_it_chose() -> None:
    assert _shard.__name__ in _native.C_TWINS
    assert _shard.shard_index is chosen(_shard).shard_index
    assert _shard.ShardLock is chosen(_shard).ShardLock
    assert isinstance(_shard.shard_index, types.BuiltinFunctionType) == _shard.COMPILED
    assert reference.ShardLock is threading.Lock
    assert (_shard.ShardLock is threading.Lock) != _shard.COMPILED


def _same_shard(c: types.ModuleType, *args: Any) -> None:
    def answer(shard_index: Callable[..., int]) -> Any:
        try:
            return shard_index(*args)
        except (ValueError, TypeError, OverflowError) as exc:
            return type(exc), str(exc) if isinstance(exc, ValueError) else ""

    assert answer(c.shard_index) == answer(reference.shard_index), args


@FAST
@given(st.text(max_size=60), st.integers(1, 64) | st.sampled_from([1, 16, 2**31, 2**62, 2**63 - 1]))
def test_shard_twins_agree(shard_c: types.ModuleType, key: str, shards: int) -> None:
    _same_shard(shard_c, key, shards)
    assert 0 <= shard_c.shard_index(key, shards) < shards


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
def test_shard_twins_agree_on_bad_arguments(shard_c: types.ModuleType, args: tuple[Any, ...]) -> None:
    _same_shard(shard_c, *args)


def test_shard_lock_twins_agree(shard: types.ModuleType) -> None:
    lock_type = shard.ShardLock
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
        lock_type(1)
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


def test_shard_lock_excludes_and_waits_without_the_gil(shard: types.ModuleType, fast_switching: None) -> None:
    lock, count, rounds = shard.ShardLock(), [0], 2000

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
