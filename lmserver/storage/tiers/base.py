"""The small interface every storage tier behind memory implements (disk, NIXL, HF Buckets).

Strategy: the memory tier is special (it owns the buffers the connection receives into and
sends from, and is used synchronously on the event loop), so it is not one of these. Every
tier *behind* it is asynchronous and byte-oriented, and knows nothing of the other tiers:
the Store (``lmserver/storage/store.py``) chains them, decides what is written where, and keeps
per-key order across the chain.

* ``put`` takes the object as a read-only buffer that stays valid and unchanged until the
  awaitable finishes (the Store pins it), and returns False when the tier declines it
  (too large, out of space, I/O error): the tier has then logged and counted why.
* ``get_into`` reads an object into memory obtained from ``alloc(length)``, so a hit lands
  straight in the memory tier's buffer (promotion without a copy). It returns the object's
  metadata, or None on a miss, and never returns torn or corrupt data.
* ``contains`` and ``keys`` answer from the tier's in-memory index, so EXIST and LIST
  never wait for I/O. ``may_hold`` says whether a GET should ask the tier at all (a shared
  tier that probes its backend says yes for keys it has not indexed yet).
* **Eviction hands off instead of dropping.** When a tier evicts an object to make room it
  calls ``self.hand_off(victim)``: the Store (which set ``on_evict``) may keep the victim
  to demote it to the next tier, and calls ``victim.release()`` when done; with no taker
  the victim is released at once. A tier whose victims cannot be read back cheaply may
  simply never hand off (its victims are dropped): demotion out of it is then off.
  ``hand_off`` never blocks, so eviction never waits for another tier's I/O. What a held
  victim occupies still counts against the evicting tier's capacity until released.

Blocking work runs in threads owned by the tier (see ``threaded.py``), never on the loop.
A tier is configured from a ``TierSpec`` (``spec.py``) through ``from_spec``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lmproto import ObjectMeta

from .errors import ConfigError, NoSpace, TierError

if TYPE_CHECKING:
    from .spec import Mode, TierSpec

Alloc = Callable[[int], memoryview]
"""Returns a writable buffer of exactly the given length, or raises NoSpace."""


@dataclass
class TierUsage:
    """What a tier reports in STATS; ``counters`` are monotonic totals kept by the tier."""

    objects: int
    bytes: int
    capacity: int
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"objects": self.objects, "bytes": self.bytes, "capacity": self.capacity, **self.counters}


class Victim(abc.ABC):
    """An object a tier evicted but still holds, so it can be demoted to the next tier.

    ``open`` and ``release`` may block (file I/O): the Store calls them from a worker
    thread. ``open`` returns the verified bytes, valid until ``release``; it raises
    ``TierError`` when they cannot be read or fail their checksum.

    No ``__slots__`` here: mypyc refuses to compile a subclass (memory.MemoryVictim) of a
    Python class that has them.
    """

    def __init__(self, key: str, length: int, meta: ObjectMeta) -> None:
        self.key = key
        self.length = length
        self.meta = meta

    @abc.abstractmethod
    def open(self) -> memoryview: ...

    @abc.abstractmethod
    def release(self) -> None:
        """Drop the object for good (idempotent)."""


EvictHook = Callable[[Victim], None]


COMMON_COUNTERS = ("hits", "misses", "puts", "deletes", "evictions", "corrupt", "missing")
"""Counters every storing tier reports in ``usage().counters`` (each adds its own)."""


class Tier(abc.ABC):
    """A storage tier behind the memory tier."""

    name: str = "tier"
    default_mode: Mode = "demote"
    """What lands here unless the spec says ``mode=``: remote tiers take only what the tiers
    in front evict (every PUT would cross the network); the disk takes every PUT."""
    on_evict: EvictHook | None = None
    """Set by the Store: takes ownership of handed-off victims. Called from any thread."""

    @classmethod
    def from_spec(cls, spec: TierSpec) -> Tier:
        """Build the tier from ``--tier`` options; raise ConfigError for bad ones."""
        raise ConfigError(f"tier kind {spec.kind!r} cannot be configured from a spec")

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Load persisted state; called once before the server accepts connections."""

    @abc.abstractmethod
    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool: ...

    @abc.abstractmethod
    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None: ...

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

    def may_hold(self, key: str) -> bool:
        """Whether a GET that missed the tiers in front should ask this tier for ``key``.
        ``contains`` for most tiers; a shared tier that looks in its backend when a GET
        misses its index (``probe``) also says True for keys it has not indexed: another
        server may have written them since its last refresh. EXIST never uses this."""
        return self.contains(key)

    def touch(self, key: str) -> None:  # noqa: B027 - optional hook
        """A tier in front served ``key``: refresh its recency here too, so this tier's LRU
        order (and the order it persists across restarts) follows real use. Must not block."""

    @abc.abstractmethod
    async def delete(self, key: str) -> bool: ...

    @abc.abstractmethod
    def keys(self, prefix: str = "") -> Iterable[str]:
        """Keys starting with ``prefix``, in sorted order."""

    @abc.abstractmethod
    def usage(self) -> TierUsage: ...

    @property
    def healthy(self) -> bool:
        """False while the backend is failing (reported in STATS); the chain keeps serving."""
        return True

    @property
    def complete_index(self) -> bool:
        """Whether ``contains`` knows every object the backend holds. A tier shared with
        other servers (a bucket) learns their writes only on refresh: EXIST may then say
        no for an object a GET would find (see the spec)."""
        return True

    def hand_off(self, victim: Victim) -> None:
        """Give an evicted object to the Store for demotion, or drop it. Never blocks
        (the taker queues the work); safe from any thread."""
        hook = self.on_evict
        if hook is None:
            victim.release()
        else:
            hook(victim)

    @abc.abstractmethod
    async def close(self) -> None: ...


__all__ = [
    "COMMON_COUNTERS",
    "Alloc",
    "ConfigError",  # the errors live in errors.py (spec.py raises them too); here for tiers
    "EvictHook",
    "NoSpace",
    "Tier",
    "TierError",
    "TierUsage",
    "Victim",
]
