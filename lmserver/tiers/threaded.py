"""Running a tier's blocking work in its own threads, awaited safely from the event loop.

Strategy: every tier's library calls (file I/O, SQLite, NIXL transfers, Hub HTTP) block, so
they run in a bounded pool owned by the tier. Two rules make that safe, written once here:

* An await of a worker is **uncancellable**: a worker may be reading or writing the
  caller's buffer, so a cancelled caller still waits for it to finish before the buffer can
  be reused, then re-raises the cancellation.
* After ``shutdown`` nothing new starts: ``run`` raises ``TierClosed`` instead of the
  executor's RuntimeError, so callers treat it as a miss or a declined write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

from .base import TierError

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
