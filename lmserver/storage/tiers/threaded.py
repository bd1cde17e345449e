"""Running a tier's blocking work in its own threads, awaited safely from the event loop.

Strategy: every tier's library calls (file I/O, SQLite, NIXL transfers, Hub HTTP) block, so
they run in a bounded pool owned by the tier. Two rules make that safe, written once here:

* An await of a worker is **uncancellable**: a worker may be reading or writing the
  caller's buffer, so a cancelled caller still waits for it to finish before the buffer can
  be reused, then re-raises the cancellation.
* After ``shutdown`` nothing new starts: ``run`` raises ``TierClosed`` instead of the
  executor's RuntimeError, so callers treat it as a miss or a declined write.

``Completions`` hands results from threads to an event loop's futures one batch per wake-up:
a wake-up (``call_soon_threadsafe``) per object written was the largest cost of a stream of
64 KiB disk writes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from .errors import TierError

_T = TypeVar("_T")
_P = ParamSpec("_P")


class TierClosed(TierError):
    """The tier was closed; no new work starts."""


async def uncancellable(fut: asyncio.Future[_T]) -> _T:
    """Await a worker's result; if cancelled meanwhile, still wait for the worker to finish
    (it may be reading or writing the caller's buffer), then re-raise the cancellation."""
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(fut)
            break
        except asyncio.CancelledError:
            if fut.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


class Workers:
    """A tier's bounded thread pool."""

    def __init__(self, threads: int, name: str) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"lmserver-{name}")
        self.closed = False

    async def run(self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs) -> _T:
        """``fn(*args, **kwargs)`` on a worker thread, awaited uncancellably."""
        if self.closed:
            raise TierClosed("tier is closed")
        call = functools.partial(fn, *args, **kwargs)
        try:
            fut = asyncio.get_running_loop().run_in_executor(self._pool, call)
        except RuntimeError:  # the pool shut down meanwhile
            raise TierClosed("tier is closed") from None
        return await uncancellable(fut)

    def submit(
        self, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
    ) -> concurrent.futures.Future[_T]:
        if self.closed:
            raise TierClosed("tier is closed")
        return self._pool.submit(fn, *args, **kwargs)

    def shutdown(self, wait: bool = True) -> None:
        """Finish what was started (when ``wait``), start nothing new."""
        self.closed = True
        self._pool.shutdown(wait=wait)


class Completions:
    """Results set from any thread on futures of one event loop: the loop is woken once for
    everything set since its last wake-up, not once per result."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future[Any], Any]] = []
        self._scheduled = False

    def set_result(self, future: asyncio.Future[_T], result: _T) -> None:
        with self._lock:
            self._pending.append((future, result))
            if self._scheduled:
                return
            self._scheduled = True
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits these now
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for future, result in batch:
            if not future.done():
                future.set_result(result)
