"""NixlTier: a capacity-bounded LRU tier on NIXL storage (files through POSIX/GDS, or S3 OBJ).

Strategy:

* **Index** (``LRUIndex``): key -> record (location, sizes, CRC, v1 metadata) answers
  EXIST, LIST and capacity without I/O. It is rebuilt at ``open()`` from the objects
  themselves, which are self-describing (``_diskfile`` format), so nothing else needs to be
  persisted: the backend *is* the persisted metadata, and the same scan lets another server
  learn what this one wrote. After a restart the LRU order is the write order.
* **Layouts**: ``dynamic`` (one file/object per object, named by the key's SHA-256) and
  ``static`` (a fixed pool of slots, each holding one object of at most ``slot_size``;
  larger objects are declined and counted ``declined_too_large``: spanning slots would turn
  one object into several transfers and a partial-failure state for a layout meant for
  fixed-size KV chunks). In the static layout eviction does no I/O: the victim's slot goes
  back to the free list and the next write overwrites it.
* **I/O**: transfers run on lanes (``_lanes``: one agent + one thread + one registered
  staging buffer each); every operation has a deadline (``timeout``), after which the
  caller gets a miss / a declined write, the tier turns unhealthy until a transfer
  succeeds, and the event is counted and logged (throttled). Listing, header probes and
  deletions run on a small metadata pool.
* **Verification**: a read checks the header (magic, CRC, key, lengths, metadata) and the
  body CRC, computed on the caller's buffer after the copy; anything else is a miss,
  counted ``corrupt`` (or ``missing``) and dropped from the index and the backend.
* **Shared storage** (``shared=true``, dynamic layout): several servers use one directory
  or bucket. Each indexes what it wrote, learns what others wrote from a listing every
  ``refresh`` seconds, and (``probe=true``) looks in the backend when a GET misses the
  index (``may_hold``: the Store asks this tier on every GET that missed the tiers in
  front; ``probing.ProbeGate`` bounds the look-ups). EXIST answers from the index only, so
  it may say no for an object written elsewhere less than ``refresh`` seconds ago
  (``complete_index`` is False).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, TypeVar

import structlog

from lmproto import ObjectMeta

from ....logs import ThrottledWarnings
from .. import _diskfile
from ..base import COMMON_COUNTERS, Alloc, Tier, TierError, TierUsage, Victim
from ..lru_index import LRUIndex
from ..probing import ProbeGate
from ..spec import TierSpec
from ..threaded import TierClosed, Workers
from ._agent import Agent, TransferTimeout, check_gds, load_api
from ._lanes import Guard, Lane, LaneBusy, OpTimeout, run_bounded
from ._options import DEFAULT_REFRESH_S, NixlOptions, io_length_for, parse
from ._stores import Corrupt, Location, Missing, Store, Unreachable, make_store

log = structlog.get_logger(__name__)

_T = TypeVar("_T")
_STRIPES = 64
_META_THREADS = 4
_WARN_INTERVAL_S = 10.0
_DECLINED_REMEMBERED = 1024  # objects declined as too large, so that each is counted once
_COUNTERS = (
    *COMMON_COUNTERS,
    "timeouts",
    "errors",
    "declined_too_large",
    "declined_no_space",
    "declined_busy",
    "declined_invalid",
    "refreshes",
    "refreshed_in",
    "refreshed_out",
    "probes",
    "probe_hits",
    "probes_skipped",
)


class _Rec(NamedTuple):
    """One indexed object. Compared by identity: a newer version is a new _Rec."""

    loc: Location
    size: int  # bytes it occupies in the backend (a whole slot in the static layout)
    header_len: int
    body_len: int
    crc: int
    meta: ObjectMeta
    written_ns: int
    seen: float  # time.monotonic() when it entered this index (refresh keeps newer ones)


class _NixlVictim(Victim):
    __slots__ = ("_rec", "_released", "_tier")

    def __init__(self, tier: NixlTier, key: str, rec: _Rec) -> None:
        super().__init__(key, rec.body_len, rec.meta)
        self._tier = tier
        self._rec = rec
        self._released = False

    def open(self) -> memoryview:
        return self._tier._read_victim(self.key, self._rec)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._tier._free(self.key, self._rec)


class _ReadVictim(Victim):
    """A static slot's victim, read into memory when evicted (its slot is already reused)."""

    __slots__ = ("_data",)

    def __init__(self, key: str, meta: ObjectMeta, data: memoryview) -> None:
        super().__init__(key, len(data), meta)
        self._data: memoryview | None = data

    def open(self) -> memoryview:
        if self._data is None:
            raise TierError("victim already released")
        return self._data

    def release(self) -> None:
        self._data = None


class NixlTier(Tier):
    """See the module docstring. Build with ``NixlTier.from_spec(TierSpec.parse(...))``."""

    default_mode = "demote"

    @classmethod
    def from_spec(cls, spec: TierSpec) -> NixlTier:
        return cls(parse(spec))

    def __init__(self, opts: NixlOptions) -> None:
        self._api = load_api()  # ConfigError when nixl is not installed
        if opts.backend in ("GDS", "GDS_MT"):
            check_gds(opts.backend)
        self.opts = opts
        self.name = opts.name
        self.capacity = opts.capacity
        self._index: LRUIndex[_Rec] = LRUIndex(opts.capacity)
        self._store: Store = make_store(opts)
        self._lanes: list[Lane] = []
        self._meta: Workers | None = None
        self._mu = threading.Lock()
        self._free_slots: list[int] = []
        self._writing: dict[str, int] = {}
        self._stripes = [threading.Lock() for _ in range(_STRIPES)]
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._declined: collections.OrderedDict[str, int] = collections.OrderedDict()  # key: size
        self._probes = ProbeGate()
        self._healthy = True
        self._warnings = ThrottledWarnings(log, _WARN_INTERVAL_S)
        self._refresher: asyncio.Task[None] | None = None
        self._pending_load = False
        self._closed = False

    # -- lifecycle -------------------------------------------------------------------------

    async def open(self) -> None:
        if self._meta is not None:
            raise RuntimeError("NixlTier.open() called twice")
        self._meta = Workers(_META_THREADS, f"{self.name}-meta")
        try:
            await self._meta.run(self._open_sync)
        except BaseException:
            self._closed = True
            await asyncio.to_thread(self._close_sync)
            raise
        if (self.opts.shared and self.opts.refresh > 0) or self._pending_load:
            self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())

    def _open_sync(self) -> None:
        started = time.monotonic()
        opts = self.opts
        try:
            self._store.open()
            reachable = True
        except Unreachable as exc:
            reachable = False
            self._failed("errors", "nixl tier: backend unreachable at open; starting empty", error=str(exc))
        params = self._backend_params()
        for i in range(opts.lanes):
            agent = Agent(self._api, f"lmserver-{self.name}-{i}-{id(self):x}", opts.backend, params)
            lane = Lane(i, agent, opts.staging_bytes, self.name)
            self._lanes.append(lane)
            self._store.attach(lane)
        found = 0
        if reachable:
            try:
                found = self._load()
            except (TierError, OSError) as exc:
                reachable = False
                self._failed("errors", "nixl tier: listing failed at open; starting empty", error=str(exc))
        # A dynamic layout loads what the backend holds once it answers (a static pool
        # cannot: its free slots are being reused meanwhile).
        self._pending_load = not reachable and opts.layout == "dynamic"
        log.info(
            "nixl tier opened",
            where=opts.where(),
            backend=opts.backend,
            layout=opts.layout,
            objects=len(self._index),
            bytes=self._index.bytes,
            capacity=self.capacity,
            found=found,
            lanes=opts.lanes,
            shared=opts.shared,
            seconds=round(time.monotonic() - started, 3),
        )

    def _backend_params(self) -> dict[str, str]:
        opts = self.opts
        params: dict[str, str] = {}
        if opts.is_obj:
            params["bucket"] = opts.bucket
            params["region"] = opts.region
            params["use_virtual_addressing"] = "true" if opts.virtual_host else "false"
            if opts.endpoint:
                scheme, _, rest = opts.endpoint.partition("://")
                params["endpoint_override"] = opts.endpoint
                params["scheme"] = scheme if rest else "https"
            if opts.access_key:
                params["access_key"] = opts.access_key
                params["secret_key"] = opts.secret_key
            # Objects above 5 MiB go through the AWS CRT client: 15x faster for a 32 MiB
            # PUT against a local S3 server than the default client.
            params["crtMinLimit"] = str(5 << 20)
        params.update(opts.params)
        return params

    def _load(self) -> int:
        """Index every whole object the backend holds, oldest write first."""
        found: dict[str, _Rec] = {}
        stale: list[Location] = []
        now = time.monotonic()
        for loc, head, stored in self._store.scan():
            rec_key = self._record_from(loc, head, stored, now)
            if rec_key is None:
                continue
            key, rec = rec_key
            other = found.get(key)
            if other is not None:  # static layout: an older copy in another slot
                older = other if other.written_ns <= rec.written_ns else rec
                stale.append(older.loc)
                if older is rec:
                    continue
            found[key] = rec
        for loc in stale:
            with contextlib.suppress(OSError, TierError):
                self._store.delete(loc)
        used: set[Location] = set()
        for key, rec in sorted(found.items(), key=lambda kv: kv[1].written_ns):
            if key not in self._index:  # a retried load keeps what was written since open
                self._index.load(key, rec)
            used.add(rec.loc)
        if self.opts.layout == "static":
            self._free_slots = [s for s in range(self.opts.slots - 1, -1, -1) if s not in used]
        self._evict(self._index.overflow())
        return len(found)

    def _record_from(self, loc: Location, head: bytes, stored: int, seen: float) -> tuple[str, _Rec] | None:
        """The record of a whole object whose header is ``head``, or None."""
        try:
            h = _diskfile.decode_header(head)
        except _diskfile.CorruptFile:
            return None
        if not self._store.whole(h, stored):
            return None
        if isinstance(loc, str) and _diskfile.object_name(h.key.encode()) != loc:
            return None
        size = self.opts.slot_size if self.opts.layout == "static" else io_length_for(self.opts, h.size)
        return h.key, _Rec(loc, size, h.header_len, h.body_len, h.body_crc, h.meta, h.written_ns, seen)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._refresher
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        lanes, self._lanes = self._lanes, []
        for lane in lanes:
            lane.stop()
            self._store.detach(lane)
            lane.close()
        if self._meta is not None:
            self._meta.shutdown(wait=True)
        self._store.close()
        idx = self._index
        log.info("nixl tier closed", where=self.opts.where(), objects=len(idx), bytes=idx.bytes)

    # -- Tier interface: answers from memory ----------------------------------------------

    def contains(self, key: str) -> bool:
        return key in self._index

    def may_hold(self, key: str) -> bool:
        return self.opts.probe or key in self._index

    def keys(self, prefix: str = "") -> Iterable[str]:
        return self._index.keys(prefix)

    def touch(self, key: str) -> None:
        self._index.touch(key)

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def complete_index(self) -> bool:
        return not self.opts.shared

    def usage(self) -> TierUsage:
        idx = self._index
        with self._mu:
            counters = dict(self._counters)
        with idx.lock:
            counters["inflight_bytes"] = idx.reserved + idx.doomed
            return TierUsage(len(idx), idx.bytes, self.capacity, counters)

    # -- Tier interface: I/O ---------------------------------------------------------------

    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool:
        if self._closed or not self._lanes:
            return False
        try:
            data, key_bytes, header_len = _diskfile.prepare(key, data, meta)
        except ValueError:
            self._count("declined_invalid")
            return False
        total = header_len + len(data)
        if total > self.opts.max_object or total > self.capacity:
            if self._first_decline(key, total):
                self._count("declined_too_large")
                self._warn("object larger than the nixl tier takes", size=total, limit=self.opts.max_object)
            return False
        guard = Guard()
        try:
            return await self._bounded(
                guard, lambda lane: self._put_sync(lane, guard, key, key_bytes, data, meta)
            )
        except OpTimeout:
            if guard.report_failure():
                self._failed("timeouts", "nixl tier: a write timed out", key=key)
        except LaneBusy:
            self._count("declined_busy")
        except TierClosed:
            pass
        return False

    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None:
        if self._closed or not self._lanes:
            return None
        rec = self._index.get(key)
        if rec is None and self.opts.probe:
            rec = await self._probe(key)
        if rec is None:
            self._count("misses")
            return None
        buf = alloc(rec.body_len)  # may raise NoSpace: nothing to undo
        if len(buf) != rec.body_len:
            raise ValueError(f"alloc returned {len(buf)} bytes, asked for {rec.body_len}")
        guard = Guard()
        try:
            ok = await self._bounded(guard, lambda lane: self._get_sync(lane, guard, key, rec, buf))
        except OpTimeout:
            if guard.report_failure():
                self._failed("timeouts", "nixl tier: a read timed out; served as a miss", key=key)
            ok = False
        except LaneBusy:
            self._count("declined_busy")
            ok = False
        except TierClosed:
            ok = False
        if not ok:
            self._count("misses")
            return None
        return rec.meta

    async def delete(self, key: str) -> bool:
        if self._closed or self._meta is None or key not in self._index:
            return False
        try:
            return await self._meta.run(self._delete_sync, key)
        except TierClosed:
            return False

    async def _bounded(self, guard: Guard, op: Callable[[Lane], _T]) -> _T:
        lanes = self._lanes
        if not lanes:
            raise TierClosed("tier is closed")
        lane = min(lanes, key=lambda ln: ln.pending)
        return await run_bounded(lane, guard, lambda: op(lane), self.opts.timeout)

    # -- lane-thread side -------------------------------------------------------------------

    def _put_sync(
        self, lane: Lane, guard: Guard, key: str, key_bytes: bytes, data: memoryview, meta: ObjectMeta
    ) -> bool:
        if guard.abandoned:
            return False
        deadline = time.monotonic() + self.opts.timeout
        static = self.opts.layout == "static"
        total = _diskfile.header_size(key_bytes) + len(data)
        size = self.opts.slot_size if static else io_length_for(self.opts, total)
        victims = self._index.reserve(size)
        if victims is None:
            self._count("declined_no_space")
            self._warn("nixl tier full of writes in flight; object not stored", size=size)
            return False
        self._evict(victims, lane)
        loc: Location
        if static:
            with self._mu:
                slot = self._free_slots.pop() if self._free_slots else None
            if slot is None:  # every free slot is still held by a victim being demoted
                self._index.cancel(size)
                self._count("declined_no_space")
                return False
            loc = slot
        else:
            loc = _diskfile.object_name(key_bytes)
        with self._stripe(key), self._mu:
            self._writing[key] = self._writing.get(key, 0) + 1
        try:
            rec = self._write(lane, guard, key, key_bytes, data, meta, loc, size, deadline)
        finally:
            with self._mu:
                left = self._writing[key] - 1
                if left:
                    self._writing[key] = left
                else:
                    del self._writing[key]
        if rec is None:
            self._index.cancel(size)
            if static:
                assert isinstance(loc, int)
                with self._mu:
                    self._free_slots.append(loc)
            return False
        old = self._index.commit(key, rec, size)
        if old is not None and static and old.loc != loc:
            assert isinstance(old.loc, int)
            with self._mu:
                self._free_slots.append(old.loc)  # the newer copy's written_ns wins at a scan
        self._succeeded("puts")
        return True

    def _write(
        self,
        lane: Lane,
        guard: Guard,
        key: str,
        key_bytes: bytes,
        data: memoryview,
        meta: ObjectMeta,
        loc: Location,
        size: int,
        deadline: float,
    ) -> _Rec | None:
        if not guard.enter():
            return None
        try:
            crc = _diskfile.checksum(data)
            written_ns = time.time_ns()
            header = _diskfile.encode_header(key_bytes, len(data), crc, meta, written_ns)
            hl = len(header)
            lane.view[:hl] = header
            lane.view[hl : hl + len(data)] = data
        finally:
            guard.leave()
        try:
            self._store.write(lane, loc, hl + len(data), deadline)
        except (TierError, OSError) as exc:
            kind = "timeouts" if isinstance(exc, TransferTimeout) else "errors"
            if guard.report_failure():
                self._failed(kind, "nixl tier write failed; object not stored", key=key, error=str(exc))
            return None
        return _Rec(loc, size, hl, len(data), crc, meta, written_ns, time.monotonic())

    def _get_sync(self, lane: Lane, guard: Guard, key: str, rec: _Rec, buf: memoryview) -> bool:
        if guard.abandoned:
            return False
        outcome = self._read_into(lane, guard, key, rec, buf, time.monotonic() + self.opts.timeout)
        if outcome == "hit":
            self._index.touch(key)
            self._succeeded("hits")
            return True
        if outcome in ("corrupt", "missing"):
            self._drop(key, rec, outcome)
        return False

    def _read_into(
        self, lane: Lane, guard: Guard | None, key: str, rec: _Rec, buf: memoryview, deadline: float
    ) -> str:
        """Read and verify ``rec`` into ``buf``: "hit", "corrupt", "missing", "error" or
        "abandoned"."""
        n = rec.header_len + rec.body_len
        try:
            self._store.read(lane, rec.loc, n, deadline)
        except Missing:
            return "missing"
        except Corrupt:
            return "corrupt"
        except (TierError, OSError) as exc:
            kind = "timeouts" if isinstance(exc, TransferTimeout) else "errors"
            if guard is None or guard.report_failure():
                self._failed(kind, "nixl tier read failed; served as a miss", key=key, error=str(exc))
            return "error"
        try:
            h = _diskfile.decode_header(lane.view[: rec.header_len])
        except _diskfile.CorruptFile:
            return "corrupt"
        if (h.key, h.body_len, h.body_crc, h.meta) != (key, rec.body_len, rec.crc, rec.meta):
            return "corrupt"
        if guard is not None and not guard.enter():
            return "abandoned"
        try:
            buf[:] = lane.view[rec.header_len : n]
            ok = _diskfile.checksum(buf) == rec.crc
        finally:
            if guard is not None:
                guard.leave()
        return "hit" if ok else "corrupt"

    # -- victims, drops and deletes (lane, metadata or Store worker threads) ------------------

    def _evict(self, victims: list[tuple[str, _Rec]], lane: Lane | None = None) -> None:
        """Hand evicted records off (for demotion) or free them.

        A static slot must be free for the write that evicted it, so a victim somebody
        wants (``on_evict`` set) is read into memory first, on this lane, and its slot
        freed at once; with no taker the slot is reused with no I/O at all.
        """
        if not victims:
            return
        with self._mu:
            self._counters["evictions"] += len(victims)
        static = self.opts.layout == "static"
        for key, rec in victims:
            # Out of the index but still in the backend until released (``_free`` forgets).
            self._index.hold(rec.size)
            if not static:
                self.hand_off(_NixlVictim(self, key, rec))
            elif self.on_evict is None:
                self._free(key, rec)
            else:
                try:
                    data = self._read_victim(key, rec, lane)
                except TierError as exc:
                    self._warn("nixl tier: an evicted object could not be read for demotion", error=str(exc))
                    data = None
                self._free(key, rec)
                if data is not None:
                    self.hand_off(_ReadVictim(key, rec.meta, data))

    def _read_victim(self, key: str, rec: _Rec, lane: Lane | None = None) -> memoryview:
        """Blocking read of an evicted object for demotion (a Store worker thread, or
        ``lane``'s own thread during the put that evicted it)."""
        buf = memoryview(bytearray(rec.body_len))
        if lane is None:
            lane = next((ln for ln in self._lanes if ln.on_thread()), None)
        if lane is not None:
            outcome = self._read_into(lane, None, key, rec, buf, time.monotonic() + self.opts.timeout)
        else:
            if not self._lanes:
                raise TierError("nixl tier is closed")
            chosen = min(self._lanes, key=lambda ln: ln.pending)
            deadline = time.monotonic() + self.opts.timeout
            read = functools.partial(self._read_into, chosen, None, key, rec, buf, deadline)
            outcome = chosen.submit(read).result()
        if outcome != "hit":
            if outcome == "corrupt":
                self._count("corrupt")
            raise TierError(f"evicted object {key!r} could not be read back ({outcome})")
        return buf

    def _free(self, key: str, rec: _Rec) -> None:
        """Release the storage of a record already out of the index (doomed bytes)."""
        try:
            if self.opts.layout == "static":
                assert isinstance(rec.loc, int)
                with self._mu:
                    self._free_slots.append(rec.loc)  # reused as it is: no I/O
            else:
                with self._stripe(key):
                    # A newer version of the key may be indexed or being written under the
                    # same name: leave it alone.
                    if key not in self._index and key not in self._writing:
                        self._store.delete(rec.loc)
        except (TierError, OSError) as exc:
            self._failed("errors", "nixl tier: could not remove an evicted object", key=key, error=str(exc))
        finally:
            self._index.forget(rec.size)

    def _drop(self, key: str, rec: _Rec, reason: str) -> None:
        """Remove a corrupt or missing object (if the index still holds this version)."""
        self._warn(f"nixl tier: {reason} object dropped", key=key)
        if self._index.remove(key, rec, doom=True) is None:
            return  # replaced or deleted while it was read: not this version's fault
        self._count(reason)
        if self.opts.layout == "static":
            with contextlib.suppress(TierError, OSError):
                self._store.delete(rec.loc)  # invalidate, so a restart does not revive it
        self._free(key, rec)

    def _delete_sync(self, key: str) -> bool:
        rec = self._index.remove(key, doom=True)
        if rec is None:
            return False
        try:
            with self._stripe(key):
                if key not in self._writing:
                    self._store.delete(rec.loc)
        except (TierError, OSError) as exc:
            self._failed("errors", "nixl tier: delete failed", key=key, error=str(exc))
        finally:
            if self.opts.layout == "static":
                assert isinstance(rec.loc, int)
                with self._mu:
                    self._free_slots.append(rec.loc)
            self._index.forget(rec.size)
        self._count("deletes")
        return True

    # -- shared storage: probe and refresh -----------------------------------------------------

    async def _probe(self, key: str) -> _Rec | None:
        """Look in the backend for a key another server wrote since the last refresh."""
        assert self._meta is not None
        if not self._probes.enter():
            self._count("probes_skipped")
            return None
        try:
            return await asyncio.wait_for(self._meta.run(self._probe_sync, key), self.opts.timeout)
        except TimeoutError:
            self._probes.failed()
            self._failed("timeouts", "nixl tier: a probe timed out; served as a miss", key=key)
            return None
        except TierClosed:
            return None
        finally:
            self._probes.leave()

    def _probe_sync(self, key: str) -> _Rec | None:
        self._count("probes")
        name = _diskfile.object_name(key.encode())
        try:
            got = self._store.probe(name)
        except (TierError, OSError) as exc:
            self._probes.failed()
            self._failed("errors", "nixl tier: probe failed", error=str(exc))
            return None
        if got is None:
            return None
        found = self._record_from(name, got[0], got[1], time.monotonic())
        if found is None or found[0] != key:
            return None
        rec = found[1]
        current = self._index.adopt(key, rec)
        if current is not rec:
            return current  # indexed meanwhile (a listing, a write)
        self._evict(self._index.overflow())
        self._count("probe_hits")
        return rec

    async def _refresh_loop(self) -> None:
        assert self._meta is not None
        while True:
            await asyncio.sleep(self.opts.refresh or DEFAULT_REFRESH_S)
            try:
                if self._pending_load:
                    await self._meta.run(self._retry_load)
                elif self.opts.shared and self.opts.refresh > 0:
                    await self._meta.run(self.refresh_sync)
                else:
                    return
            except TierClosed:
                return

    def _retry_load(self) -> None:
        try:
            if self._store.reopen():
                found = self._load()
                self._pending_load = False
                log.info("nixl tier: backend reachable again; index loaded", objects=found)
        except (TierError, OSError) as exc:
            self._failed("errors", "nixl tier: backend still unreachable", error=str(exc))

    def refresh_sync(self) -> None:
        """Match the index with a listing of the backend (shared mode; blocking)."""
        started = time.monotonic()
        try:
            names = self._store.listing()
        except (TierError, OSError) as exc:
            self._failed("errors", "nixl tier: refresh listing failed", error=str(exc))
            return
        with self._index.lock:
            known = {rec.loc: (key, rec) for key, rec in self._index.records.items()}
        gone = [(key, rec) for loc, (key, rec) in known.items() if loc not in names and rec.seen < started]
        for key, rec in gone:
            if self._index.remove(key, rec, doom=False) is not None:
                self._count("refreshed_out")
        added = 0
        for name in names - known.keys():
            try:
                got = self._store.probe(name)
            except (TierError, OSError) as exc:
                self._failed("errors", "nixl tier: refresh probe failed", error=str(exc))
                return
            if got is None:
                continue
            found = self._record_from(name, got[0], got[1], time.monotonic())
            if found is None or found[0] in self._index:
                continue
            self._index.load(*found)
            added += 1
        self._evict(self._index.overflow())
        with self._mu:
            self._counters["refreshes"] += 1
            self._counters["refreshed_in"] += added

    # -- small helpers ---------------------------------------------------------------------------

    def _stripe(self, key: str) -> threading.Lock:
        return self._stripes[hash(key) % _STRIPES]

    def _count(self, name: str) -> None:
        with self._mu:
            self._counters[name] += 1

    def _first_decline(self, key: str, size: int) -> bool:
        """Whether this object (key and size) is declined as too large for the first time.
        The chain offers an object the tier declined again when memory evicts it (the write
        behind and then the demotion): it is one object, counted once."""
        with self._mu:
            if self._declined.get(key) == size:
                self._declined.move_to_end(key)
                return False
            self._declined[key] = size
            if len(self._declined) > _DECLINED_REMEMBERED:
                self._declined.popitem(last=False)
            return True

    def _succeeded(self, name: str) -> None:
        with self._mu:
            self._counters[name] += 1
        if not self._healthy:
            self._healthy = True
            log.info("nixl tier healthy again", where=self.opts.where())

    def _failed(self, counter: str, event: str, **kw: Any) -> None:
        with self._mu:
            self._counters[counter] += 1
        self._healthy = False
        self._warn(event, **kw)

    def _warn(self, event: str, **kw: Any) -> None:
        self._warnings.warning(event, where=self.opts.where(), **kw)
