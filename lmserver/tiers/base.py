"""The small interface every storage tier behind memory implements (disk, NIXL, HF Buckets).

Strategy: the memory tier is special (it owns the buffers the connection receives into and
sends from, and is used synchronously on the event loop), so it is not one of these. Every
tier *behind* it is asynchronous and byte-oriented:

* ``put`` takes the object as a read-only buffer that stays valid and unchanged until the
  awaitable finishes (the Store pins it), and returns False when the tier declines it
  (too large, out of space, I/O error): the tier has then logged and counted why.
* ``get_into`` reads an object into memory obtained from ``alloc(length)``, so a hit read
  from disk lands straight in the memory tier's buffer (promotion without a copy). It
  returns the object's metadata, or None on a miss, and never returns torn or corrupt data.
* ``contains`` and ``keys`` answer from the tier's in-memory index, so EXIST and LIST
  never wait for I/O.

Blocking work runs in a bounded thread pool owned by the tier, never on the event loop.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from lmproto import ObjectMeta

Alloc = Callable[[int], memoryview]
"""Returns a writable buffer of exactly the given length, or raises NoSpace."""


class NoSpace(Exception):
    """A buffer or storage of the requested size cannot be had right now."""


@dataclass
class TierUsage:
    objects: int
    bytes: int
    capacity: int
    counters: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"objects": self.objects, "bytes": self.bytes, "capacity": self.capacity, **self.counters}


class Tier(abc.ABC):
    """A storage tier behind the memory tier."""

    name: str = "tier"

    async def open(self) -> None:  # noqa: B027 - optional hook
        """Load persisted state; called once before the server accepts connections."""

    @abc.abstractmethod
    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool: ...

    @abc.abstractmethod
    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None: ...

    @abc.abstractmethod
    def contains(self, key: str) -> bool: ...

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

    @abc.abstractmethod
    async def close(self) -> None: ...
