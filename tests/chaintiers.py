"""A tier kept in a dict, for chain tests (like httpx's MockTransport: the real interface,
an in-process backend). It can be gated, so writes to it hang until the test opens the gate:
that is a tier slower than anything, without sleeping."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass

from lmproto import ObjectMeta
from lmserver.storage.tiers.base import Alloc, Tier, TierUsage, Victim
from lmserver.storage.tiers.lru_index import LRUIndex
from lmserver.storage.tiers.spec import Mode, TierSpec


@dataclass(frozen=True)
class Record:
    data: bytes
    meta: ObjectMeta

    @property
    def size(self) -> int:
        return len(self.data)


class DictVictim(Victim):
    def __init__(self, tier: DictTier, key: str, record: Record) -> None:
        super().__init__(key, record.size, record.meta)
        self.tier = tier
        self.record: Record | None = record

    def open(self) -> memoryview:
        assert self.record is not None
        return memoryview(self.record.data)

    def release(self) -> None:
        record, self.record = self.record, None
        if record is not None:
            self.tier.index.forget(record.size)


class DictTier(Tier):
    default_mode: Mode = "demote"
    gates: dict[str, threading.Event] = {}  # noqa: RUF012 - tests open them by tier name
    instances: dict[str, DictTier] = {}  # noqa: RUF012 - tests inspect them by name

    def __init__(self, capacity: int, name: str = "dict", gated: bool = False) -> None:
        self.name = name
        self.index: LRUIndex[Record] = LRUIndex(capacity)
        self.gate = DictTier.gates.setdefault(name, threading.Event()) if gated else None
        self.counters = {"hits": 0, "misses": 0, "puts": 0, "evictions": 0, "deletes": 0}
        DictTier.instances[name] = self

    @classmethod
    def from_spec(cls, spec: TierSpec) -> DictTier:
        return cls(
            spec.size("capacity", 1 << 30), name=spec.string("name", "dict"), gated=spec.flag("gated", False)
        )

    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool:
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait)
        record = Record(bytes(data), meta)
        victims = self.index.reserve(record.size)
        if victims is None:
            return False
        for victim_key, victim in victims:
            self.counters["evictions"] += 1
            self.index.hold(victim.size)
            self.hand_off(DictVictim(self, victim_key, victim))
        old = self.index.commit(key, record, record.size, doom_old=True)
        if old is not None:
            self.index.forget(old.size)
        self.counters["puts"] += 1
        return True

    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None:
        record = self.index.get(key)
        if record is None:
            self.counters["misses"] += 1
            return None
        alloc(record.size)[:] = record.data
        self.counters["hits"] += 1
        return record.meta

    def contains(self, key: str) -> bool:
        return key in self.index

    def touch(self, key: str) -> None:
        self.index.touch(key)

    async def delete(self, key: str) -> bool:
        record = self.index.remove(key, doom=False)
        if record is not None:
            self.counters["deletes"] += 1
        return record is not None

    def keys(self, prefix: str = "") -> Iterable[str]:
        return self.index.keys(prefix)

    def usage(self) -> TierUsage:
        return TierUsage(len(self.index), self.index.bytes, self.index.capacity, dict(self.counters))

    async def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
