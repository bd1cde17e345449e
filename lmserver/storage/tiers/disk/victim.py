"""An evicted disk record kept until the next tier has it (demotion)."""

from __future__ import annotations

import contextlib
import mmap
import threading
from typing import Protocol

from .. import _diskfile
from ..base import TierError, Victim
from .records import Record
from .segments import Segment


class Holder(Protocol):
    """What a victim needs of the tier that evicted it (``DiskTier``, which imports this
    module: the victim names a protocol, not the tier, so the two do not import each other)."""

    def victim_corrupt(self) -> None:
        """Count a victim found corrupt when opened."""

    def victim_released(self, victim: DiskVictim) -> None:
        """The victim is done with (demoted, or dropped): give its space back."""


class DiskVictim(Victim):
    """An evicted record, left in its segment (its space still counted) until ``release``.

    ``open`` maps the record read-only (records start on page boundaries) and checks it whole
    (header, key, CRC) once; the view it returns stays valid after ``release`` punches the
    record out (the mapping is unmapped only when the last view is gone; punched pages of a
    mapping read as zeros, so the Store copies before it releases).
    """

    __slots__ = ("_lock", "_map", "_released", "_tier", "record", "segment")

    def __init__(self, tier: Holder, key: str, record: Record, segment: Segment) -> None:
        super().__init__(key, record.body_len, record.meta)
        self._tier = tier
        self.record = record
        self.segment = segment  # acquired: its descriptor stays open until release
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._released = False

    def open(self) -> memoryview:
        with self._lock:
            if self._released:
                raise TierError("victim already released")
            if self._map is None:
                self._map = self._map_verified()
            start = self.record.header_len
            return memoryview(self._map)[start : start + self.length]

    def _map_verified(self) -> mmap.mmap:
        rec = self.record
        try:
            mapped = mmap.mmap(self.segment.fd, rec.size, prot=mmap.PROT_READ, offset=rec.offset)
        except (OSError, ValueError) as exc:
            raise TierError(f"evicted record unreadable: {exc}") from exc
        try:
            header = _diskfile.decode_header(memoryview(mapped)[: rec.header_len])
            with memoryview(mapped) as whole:
                body_ok = _diskfile.checksum(whole[rec.header_len : rec.header_len + self.length]) == rec.crc
        except _diskfile.CorruptFile as exc:
            mapped.close()
            self._tier.victim_corrupt()
            raise TierError(f"evicted record is corrupt: {exc}") from exc
        if header.key != self.key or header.body_crc != rec.crc or not body_ok:
            mapped.close()
            self._tier.victim_corrupt()
            raise TierError("evicted record is corrupt")
        return mapped

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            mapped, self._map = self._map, None
        if mapped is not None:
            with contextlib.suppress(BufferError):  # a reader still holds a view: the GC unmaps it
                mapped.close()
        self._tier.victim_released(self)
