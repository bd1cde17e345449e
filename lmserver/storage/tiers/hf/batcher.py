"""Group queued bucket operations into batches: one ``batch_bucket_files`` commit each.

Strategy: one thread takes jobs in arrival order. A batch closes ``window_s`` after its first
job, at ``max_ops`` operations or ``max_bytes`` of uploads, or at the first job whose path
is already in it: ``batch_bucket_files`` sends adds before deletes, so an add and a delete
of one path (or two adds) must not share a commit or their order would be lost. Under load
batches fill by themselves; a lone job waits at most one window. The queue itself is
bounded by the tier (it admits a write only while its pending bytes allow), so this module
never refuses.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Job(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def nbytes(self) -> int: ...


J = TypeVar("J", bound=Job)


class Batcher(Generic[J]):
    def __init__(
        self,
        run: Callable[[list[J]], None],
        *,
        max_ops: int,
        max_bytes: int,
        window_s: float,
        name: str = "lmserver-hf-batch",
    ) -> None:
        self._run_batch = run
        self._max_ops = max_ops
        self._max_bytes = max_bytes
        self._window_s = window_s
        self._cond = threading.Condition()
        self._queue: deque[tuple[float, J]] = deque()
        self._queued_bytes = 0
        self._closing = False
        self.running = 0  # jobs in the batch being committed now
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: J) -> None:
        with self._cond:
            if self._closing:
                raise RuntimeError("batcher is closed")
            self._queue.append((time.monotonic(), job))
            self._queued_bytes += job.nbytes
            self._cond.notify()

    @property
    def pending(self) -> int:
        """Jobs queued or being committed."""
        return len(self._queue) + self.running

    def close(self) -> None:
        """Commit everything queued, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()

    def _take(self) -> list[J] | None:
        with self._cond:
            while not self._queue and not self._closing:
                self._cond.wait()
            if not self._queue:
                return None
            deadline = self._queue[0][0] + self._window_s
            while not self._closing and not self._full():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch: list[J] = []
            paths: set[str] = set()
            nbytes = 0
            while self._queue and len(batch) < self._max_ops:
                job = self._queue[0][1]
                if job.path in paths or (batch and nbytes + job.nbytes > self._max_bytes):
                    break
                self._queue.popleft()
                self._queued_bytes -= job.nbytes
                batch.append(job)
                paths.add(job.path)
                nbytes += job.nbytes
            self.running = len(batch)
            return batch

    def _full(self) -> bool:
        return len(self._queue) >= self._max_ops or self._queued_bytes >= self._max_bytes

    def _loop(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            try:
                self._run_batch(batch)
            finally:
                with self._cond:
                    self.running = 0
