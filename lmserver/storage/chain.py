"""One link of the tier chain: a tier behind memory and the writes queued for it.

Strategy:

* **Per-key order.** Every change of a key in this tier (write-behind, demotion, discard of
  an older copy, DELETE) is a job chained behind the key's previous job, so an older
  version can never land after a newer one. While a key has a job queued or running here,
  this tier does not serve it (``readable`` is False): the key is then either newer in
  memory or held by the Store as a victim in flight, which serves it instead.
* **Bounded.** Writes pin their source (a memory entry or a held victim) until they finish;
  ``admit`` books their bytes against the link's ``queue`` budget. When it is spent the
  tier's ``full`` policy decides, in the Store: ``wait`` (the PUT's connection waits for
  room before it reads the body) or ``skip`` (counted; nobody waits). PUT_ACK writes are
  admitted over budget (the client waits for them; memory bounds them).
* Jobs are plain tasks; the tier's own thread pool bounds how many run at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from ..logs import ThrottledWarnings
from .tiers.base import Tier
from .tiers.spec import ChainOptions

log = structlog.get_logger("lmserver.storage.chain")
throttled = ThrottledWarnings(log)

COUNTERS = (
    "promotions",  # GET hits read from this tier and published in memory
    "writes",  # objects written here (write-behind, PUT_ACK and demotion)
    "write_failures",  # writes the tier declined or failed (it logged and counted why)
    "skipped_writes",  # write-behinds skipped (the three reasons below, summed)
    "skipped_queue_full",  # ... because this tier's queue was full (full=skip)
    "skipped_dirty_full",  # ... because memory's share for objects waiting for tiers was full
    "skipped_wait_timeout",  # ... because a full=wait PUT waited --memory-wait for room in vain
    "full_waits",  # PUTs that waited for room in this tier's queue before their body was read
    "demotions",  # objects written here because the tier in front evicted them
    "demotions_skipped",  # evicted objects dropped: queue full, or a newer version in flight
    "discards",  # older copies removed because a newer PUT did not reach this tier
)


class Link:
    def __init__(self, tier: Tier, options: ChainOptions, position: int) -> None:
        self.tier = tier
        self.mode = options.mode
        self.full = options.full
        self.queue_limit = options.queue_bytes
        self.position = position  # 1 = right behind memory
        self.queued_bytes = 0
        self.counters = dict.fromkeys(COUNTERS, 0)
        self._tails: dict[str, asyncio.Future[Any]] = {}

    @property
    def name(self) -> str:
        return self.tier.name

    @property
    def write_behind(self) -> bool:
        return self.mode == "write-behind"

    def busy(self, key: str) -> bool:
        return key in self._tails

    def readable(self, key: str) -> bool:
        return key not in self._tails and self.tier.contains(key)

    def fetchable(self, key: str) -> bool:
        """Whether a GET should ask this tier (``readable``, or a shared tier that looks
        in its backend for keys missing from its index)."""
        return key not in self._tails and self.tier.may_hold(key)

    @property
    def pending(self) -> int:
        return len(self._tails)

    @property
    def waits_when_full(self) -> bool:
        """Whether a PUT waits for room here (write-behind with ``full=wait``)."""
        return self.mode == "write-behind" and self.full == "wait"

    def has_room(self, length: int) -> bool:
        return self.queued_bytes + length <= self.queue_limit

    def admit(self, length: int, *, force: bool = False) -> bool:
        if not force and not self.has_room(length):
            return False
        self.queued_bytes += length
        return True

    def done_with(self, length: int) -> None:
        self.queued_bytes -= length

    def enqueue(self, key: str, job: Callable[[], Awaitable[bool]]) -> asyncio.Future[bool]:
        """Run ``job`` after every earlier job of ``key`` on this link; resolves to its result
        (False if it raised: logged here)."""
        previous = self._tails.get(key)
        task = asyncio.get_running_loop().create_task(self._run(key, previous, job))
        self._tails[key] = task
        return task

    async def _run(
        self, key: str, previous: asyncio.Future[Any] | None, job: Callable[[], Awaitable[bool]]
    ) -> bool:
        try:
            if previous is not None:
                await asyncio.wait([previous])
            return await job()
        except Exception as exc:
            self.counters["write_failures"] += 1
            throttled.warning("tier job failed", tier=self.name, error=repr(exc))
            return False
        finally:
            if self._tails.get(key) is asyncio.current_task():
                del self._tails[key]

    async def drain(self) -> None:
        while self._tails:
            await asyncio.wait(list(self._tails.values()))

    def stats(self) -> dict[str, Any]:
        usage = self.tier.usage().as_dict()
        usage.update(self.counters)
        usage.update(
            mode=self.mode,
            full=self.full,
            healthy=self.tier.healthy,
            complete_index=self.tier.complete_index,
            queue_depth=self.pending,
            queue_bytes=self.queued_bytes,
            queue_limit=self.queue_limit,
        )
        return usage
