"""Lanes: one nixl agent, one I/O thread and one registered staging buffer each.

Strategy: a transfer never runs on the event loop. Each lane owns an agent and a thread
(``Workers(1)``) that runs transfer, poll and release, so an agent is driven by one thread
and a lane's staging buffer is used by one operation at a time.

The staging buffer (page-aligned ``mmap``, registered once per agent) carries every
transfer, with one copy in and out of the caller's buffer. Chosen over registering the
caller's buffer per operation (about 5 us per register/deregister here, so not for speed):

* a timed-out transfer is given up but may still land later (an S3 GET in flight): it may
  scribble on the lane's own buffer, never on a memory-tier buffer already reused for
  another object (the checksums catch a scribbled staging buffer);
* OBJ writes a whole object from one contiguous buffer (header + body in one PUT);
* O_DIRECT needs aligned addresses, which caller buffers are not.

``Guard`` makes the operation's deadline safe for the caller: the event loop gives up on
an operation that has not started touching the caller's buffer (it is then skipped or its
result ignored), and waits out the short copy when it has.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import itertools
import mmap
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import TierError
from ..threaded import TierClosed, Workers, uncancellable
from ._agent import Agent

_T = TypeVar("_T")

MAX_PENDING = 64
"""Operations one lane queues; past it the tier declines at once (``declined_busy``)."""


class OpTimeout(TierError):
    """The operation missed its deadline; the caller's buffer is no longer used."""


class LaneBusy(TierError):
    """Every lane has ``MAX_PENDING`` operations queued."""


class Guard:
    """Who may touch the caller's buffer: the lane thread, until the caller gives up."""

    _QUEUED, _TOUCHING, _FREE, _ABANDONED = range(4)
    __slots__ = ("_lock", "_reported", "_state")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._state = self._QUEUED
        self._reported = False

    def report_failure(self) -> bool:
        """Either side: True once per operation. A timed-out transfer fails on both sides
        (the caller's deadline and the lane's), and one operation counts one failure."""
        with self._lock:
            first, self._reported = not self._reported, True
            return first

    def enter(self) -> bool:
        """Lane thread: about to touch the caller's buffer. False: the caller left."""
        with self._lock:
            if self._state == self._ABANDONED:
                return False
            self._state = self._TOUCHING
            return True

    def leave(self) -> None:
        with self._lock:
            if self._state == self._TOUCHING:
                self._state = self._FREE

    def abandon(self) -> bool:
        """Caller: give up. False while the lane is copying (wait for it instead)."""
        with self._lock:
            if self._state == self._TOUCHING:
                return False
            self._state = self._ABANDONED
            return True

    @property
    def abandoned(self) -> bool:
        return self._state == self._ABANDONED


class Lane:
    def __init__(self, index: int, agent: Agent, staging_bytes: int, name: str) -> None:
        self.index = index
        self.agent = agent
        self.staging = mmap.mmap(-1, staging_bytes)
        self.view = memoryview(self.staging)
        self._cbuf = (ctypes.c_char * staging_bytes).from_buffer(self.staging)
        self.addr = ctypes.addressof(self._cbuf)
        self.size = staging_bytes
        self._reg = agent.register_dram(self.addr, staging_bytes)
        self.attached: Any = None  # the store's per-agent registration (static pool file)
        self._workers = Workers(1, f"{name}-{index}")
        self._thread_id: int | None = None
        self._pending = 0
        self._lock = threading.Lock()
        self._devs = itertools.count(1)

    def next_dev(self) -> int:
        """A fresh OBJ device id: ids reused while registered race inside the plugin."""
        return next(self._devs)

    @property
    def pending(self) -> int:
        return self._pending

    def on_thread(self) -> bool:
        return self._thread_id == threading.get_ident()

    def submit(self, fn: Callable[[], _T]) -> concurrent.futures.Future[_T]:
        with self._lock:
            if self._pending >= MAX_PENDING:
                raise LaneBusy("lane queue full")
            self._pending += 1
        try:
            fut = self._workers.submit(self._run, fn)
        except (TierClosed, RuntimeError):
            with self._lock:
                self._pending -= 1
            raise TierClosed("tier is closed") from None
        return fut

    def _run(self, fn: Callable[[], _T]) -> _T:
        self._thread_id = threading.get_ident()
        try:
            return fn()
        finally:
            with self._lock:
                self._pending -= 1

    def stop(self) -> None:
        """Finish queued work, start nothing new (blocking)."""
        self._workers.shutdown(wait=True)

    def close(self) -> None:
        """After ``stop``: deregister and destroy the agent (blocking)."""
        if self.agent.unfinished:
            # A request given up at its deadline may still read or write the staging
            # buffer: it stays mapped and registered, alive with the agent (Agent.close);
            # this Lane may be collected, the mmap object must not be (its dealloc unmaps).
            self.agent.close(keep_alive=self.staging)
            return
        with contextlib.suppress(TierError):
            self.agent.deregister(self._reg)
        self.agent.close()
        self.view.release()
        del self._cbuf
        self.staging.close()


async def run_bounded(lane: Lane, guard: Guard, fn: Callable[[], _T], seconds: float) -> _T:
    """Run ``fn`` on ``lane``; raise OpTimeout after ``seconds`` unless it is copying
    the caller's buffer (then wait for that copy). Cancellation obeys the same rule."""
    afut = asyncio.wrap_future(lane.submit(fn))
    # An abandoned operation's outcome is never awaited: mark it retrieved.
    afut.add_done_callback(lambda f: f.cancelled() or f.exception())
    try:
        return await asyncio.wait_for(asyncio.shield(afut), seconds)
    except TimeoutError:
        if guard.abandon():
            raise OpTimeout(f"no answer within {seconds:g} s") from None
        return await uncancellable(afut)
    except asyncio.CancelledError:
        if not afut.done() and not guard.abandon():
            await uncancellable(afut)
        raise
