"""HFBucketTier: a durable tier in a Hugging Face Bucket, shareable by many lmserver instances.

Strategy:

* **Index.** An ``LRUIndex`` keyed by object name (``naming``: the SHA-256 of the key), so
  EXIST/GET find an object without knowing its key text; records learn the key from the
  object's header (our own writes know it; objects another instance wrote are read back
  lazily: a header range at most 4 KiB). ``open()`` lists the bucket (progress logged) so
  usage and eviction start exact; a refresh thread re-lists every ``refresh`` seconds, adding
  what other instances wrote and dropping what they deleted. ``contains`` never waits. With
  ``probe`` (the default) a GET that misses the index asks the bucket (one paths-info call,
  bounded by ``probing.ProbeGate``), so it finds what another instance wrote since the
  last listing.
* **Writes.** ``put`` books the bytes (evicting LRU objects if over capacity), writes header
  + body to a spool file in ``cache_dir`` on a worker thread (the one copy; the caller's
  buffer is free once that returns), and queues an add; the batcher commits many adds and
  deletes in one ``batch_bucket_files`` call. Every batch is then **reconciled** with one
  ``get_bucket_paths_info``: an add counts only if its path holds an object of its size (the
  xet hash to read it by comes from there), so rejected ops (``BucketBatchError``), ops old
  clients dropped silently, and a batch cut off by a 5xx or lost connection leave index and
  usage exact. Pending bytes are bounded (``max_pending``): past it a put is declined.
* **Reads.** ``get_into`` streams the body range straight into the buffer from ``alloc``
  (hf_xet streaming; a temp file only where streaming is missing), then checks length and
  CRC-32: a mismatch is a counted miss and the object is dropped and deleted.
* **Eviction** by watermark: once the bytes pass ``trigger`` x capacity, LRU objects are
  evicted down to ``trigger - ratio`` (one delete batch instead of one per put); the hard
  capacity is never exceeded. Victims with a known key are handed off (``HFVictim``: ``open``
  downloads and verifies, ``release`` deletes); a victim being read is deleted once the last
  reader is done.
* **Failure.** Any failed Hub call marks the tier unhealthy until ``retry_at`` (the
  server's ``Retry-After``, else exponential backoff to 60 s), and so does the first attempt
  of a call that cannot reach the Hub (not ~23 s of retries later): meanwhile puts are declined
  and GETs miss at once (counted), never waiting for the network; the refresh thread probes
  the bucket and a success makes the tier healthy again. Warnings are throttled.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import structlog

from lmproto import ObjectMeta

from ....logs import ThrottledWarnings
from .. import _diskfile
from ..base import COMMON_COUNTERS, Alloc, ConfigError, Tier, TierError, TierUsage, Victim
from ..lru_index import LRUIndex
from ..probing import ProbeGate
from ..threaded import TierClosed, Workers
from .batcher import Batcher
from .errors import HubError
from .naming import Handle, encode_header, object_name, parse_handle
from .options import Options, config_from_spec

if TYPE_CHECKING:
    from ..spec import TierSpec
    from .client import FileInfo, HubClient

log = structlog.get_logger(__name__)

UNBOUNDED = 1 << 62
_PROGRESS_EVERY = 10_000
_HEADERS_PER_ROUND = 256
_MAX_BACKOFF_S = 60.0
_COUNTERS = (
    *COMMON_COUNTERS,
    "read_errors",
    "write_failures",
    "dropped_unhealthy",
    "dropped_queue_full",
    "declined_too_large",
    "declined_no_space",
    "declined_invalid",
    "misses_unhealthy",
    "batches",
    "batch_partial",
    "reconciled",
    "delete_failures",
    "refreshes",
    "learned_from_bucket",
    "removed_by_others",
    "failures",
    "probes",
    "probe_hits",
    "probes_skipped",
)


@dataclass(eq=False, slots=True)
class _Obj:
    """One indexed object. Compared by identity: a newer version is a new record."""

    size: int
    xet_hash: str
    key: str | None = None
    header: _diskfile.Header | None = None
    readers: int = 0
    discard: bool = False  # evicted or deleted while being read: delete after the last read
    committed: float = 0.0  # monotonic time it was indexed; 0 until then


@dataclass(eq=False, slots=True)
class _Add:
    name: str
    path: str
    spool: str
    record: _Obj
    future: concurrent.futures.Future[bool]

    @property
    def nbytes(self) -> int:
        return self.record.size


@dataclass(eq=False, slots=True)
class _Delete:
    name: str
    path: str
    record: _Obj

    @property
    def nbytes(self) -> int:
        return 0


_Job = _Add | _Delete


class HFBucketTier(Tier):
    name = "hf"
    default_mode = "demote"

    def __init__(
        self,
        handle: Handle | str,
        *,
        token: str | None = None,
        endpoint: str | None = None,
        options: Options | None = None,
        client_factory: Callable[..., HubClient] | None = None,
        name: str = "hf",
    ) -> None:
        self.name = name
        self.handle = parse_handle(handle) if isinstance(handle, str) else handle
        self.opts = options = options or Options()
        if options.trigger - options.ratio < 0:
            raise ConfigError("hf tier: ratio must not exceed trigger")
        self._token = token
        self._endpoint = endpoint
        self._client_factory = client_factory
        self.capacity = options.capacity
        self._index: LRUIndex[_Obj] = LRUIndex(options.capacity or UNBOUNDED)
        self._mu = threading.Lock()  # counters, pending bytes, writing names, health
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._pending_bytes = 0
        self._writing: dict[str, int] = {}
        self._doomed_names: dict[str, int] = {}
        self._healthy = True
        self._retry_at = 0.0
        self._consecutive = 0
        self._listed = False
        self._warnings = ThrottledWarnings(log, 10.0)
        self._workers = Workers(options.workers, "hf")
        self._probes = ProbeGate()
        self._client: HubClient | None = None
        self._batcher: Batcher[_Job] | None = None
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None
        self._own_cache_dir = options.cache_dir is None
        self._cache_dir = options.cache_dir or ""
        self._closed = False

    @classmethod
    def from_spec(cls, spec: TierSpec) -> HFBucketTier:
        c = config_from_spec(spec)
        return cls(c.handle, token=c.token, endpoint=c.endpoint, options=c.options, name=c.name)

    # -- lifecycle -------------------------------------------------------------------------

    def _make_client(self) -> HubClient:
        if self._own_cache_dir:
            from .client import default_cache_dir

            self._cache_dir = default_cache_dir()
        else:
            os.makedirs(self._cache_dir, exist_ok=True)
        factory = self._client_factory
        if factory is None:
            from .client import HubClient

            factory = HubClient
        return factory(
            self.handle.bucket_id,
            token=self._token,
            endpoint=self._endpoint,
            cache_dir=self._cache_dir,
            read_mode=self.opts.read_mode,
            timeout_s=self.opts.timeout_s,
            read_piece=self.opts.read_piece,
        )

    async def open(self) -> None:
        self._client = await self._workers.run(self._make_client)
        if hasattr(self._client, "on_failed_attempt"):  # a test's stand-in may not report
            self._client.on_failed_attempt = self._attempt_failed
        # Before the listing: objects over capacity at start are deleted through it.
        self._batcher = Batcher(
            self._run_batch,
            max_ops=self.opts.batch_ops,
            max_bytes=self.opts.batch_bytes,
            window_s=self.opts.window_s,
        )
        try:
            await self._workers.run(self._open_sync)
        except BaseException:
            await self._shutdown()
            raise
        self._refresher = threading.Thread(target=self._refresh_loop, name="lmserver-hf-refresh", daemon=True)
        self._refresher.start()

    def _open_sync(self) -> None:
        client = self._client
        assert client is not None
        try:
            client.ensure_bucket(create=self.opts.create, private=self.opts.private)
            self._sync_listing()
        except HubError as exc:
            if exc.kind == "not_found":
                hint = "" if self.opts.create else " (create=true creates it)"
                raise ConfigError(f"hf tier: bucket {self.handle.bucket_id} not found{hint}") from None
            if exc.kind == "unauthorized":
                raise ConfigError(
                    f"hf tier: the Hub refused the token for bucket {self.handle.bucket_id} ({exc.status})"
                ) from None
            self._failed(exc, "hf tier: bucket unreachable at start; will retry")
        log.info(
            "hf tier opened",
            bucket=str(self.handle),
            objects=len(self._index),
            bytes=self._index.bytes,
            capacity=self.capacity,
            healthy=self._healthy,
            streaming=client.streaming,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._close_sync)

    def _close_sync(self) -> None:
        self._stop.set()
        if self._refresher is not None:
            # A listing in progress cannot be interrupted (huggingface_hub retries for ~23 s
            # when the Hub is away): do not let it hold the shutdown; it is a daemon thread.
            self._refresher.join(timeout=2.0)
        if self._batcher is not None:
            self._batcher.close()  # commits what is queued
        self._workers.shutdown(wait=True)
        if self._client is not None:
            self._client.close()
        if self._own_cache_dir and self._cache_dir:
            shutil.rmtree(self._cache_dir, ignore_errors=True)
        log.info("hf tier closed", bucket=str(self.handle), objects=len(self._index), bytes=self._index.bytes)

    async def _shutdown(self) -> None:
        self._closed = True
        if self._batcher is not None:
            await asyncio.to_thread(self._batcher.close)
        self._workers.shutdown(wait=False)
        if self._own_cache_dir and self._cache_dir:
            shutil.rmtree(self._cache_dir, ignore_errors=True)

    # -- the Tier interface ----------------------------------------------------------------

    def contains(self, key: str) -> bool:
        return object_name(key) in self._index

    def may_hold(self, key: str) -> bool:
        return self.opts.probe or self.contains(key)

    def keys(self, prefix: str = "") -> list[str]:
        with self._index.lock:
            records = list(self._index.records.values())
        return sorted(r.key for r in records if r.key is not None and r.key.startswith(prefix))

    def touch(self, key: str) -> None:
        self._index.touch(object_name(key))

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def complete_index(self) -> bool:
        return False

    def usage(self) -> TierUsage:
        with self._mu:
            counters = dict(self._counters)
            pending_bytes = self._pending_bytes
        counters.update(
            is_healthy=self._healthy,
            pending=self._batcher.pending if self._batcher is not None else 0,
            pending_bytes=pending_bytes,
        )
        return TierUsage(len(self._index), self._index.bytes, self.capacity, counters)

    async def put(self, key: str, data: memoryview, meta: ObjectMeta) -> bool:
        if self._closed or self._batcher is None:
            return False
        key_bytes = key.encode("utf-8")
        if len(key_bytes) > _diskfile.MAX_KEY_BYTES:
            self._count("declined_invalid")
            return False
        size = _diskfile.header_size(key_bytes) + len(data)
        if self.capacity and size > self.capacity:
            self._count("declined_too_large")
            return False
        if not self._usable():
            self._count("dropped_unhealthy")
            return False
        name = object_name(key)
        with self._mu:
            if self._pending_bytes + size > self.opts.max_pending:
                self._counters["dropped_queue_full"] += 1
                return False
            self._pending_bytes += size
            self._writing[name] = self._writing.get(name, 0) + 1
        victims = self._index.reserve(size)
        if victims is None:
            self._write_done(name, size)
            self._count("declined_no_space")
            return False
        self._evicted(victims)
        try:  # the CRC of the body is computed there too, off the event loop
            spool, header = await self._workers.run(self._spool, key, data, meta)
        except (OSError, ValueError, TierClosed) as exc:
            self._index.cancel(size)
            self._write_done(name, size)
            self._count("declined_invalid" if isinstance(exc, ValueError) else "write_failures")
            if isinstance(exc, OSError):
                self._warn("hf tier: spool write failed; object not stored", error=str(exc))
            return False
        record = _Obj(size, "", key, header)
        job = _Add(name, self.handle.path_of(name), spool, record, concurrent.futures.Future())
        try:
            self._batcher.submit(job)
        except RuntimeError:  # closed meanwhile
            self._finish_add(job, False)
            return False
        return await asyncio.shield(asyncio.wrap_future(job.future))

    async def get_into(self, key: str, alloc: Alloc) -> ObjectMeta | None:
        if self._closed:
            return None
        name = object_name(key)
        record = self._index.get(name)
        if record is None and self.opts.probe and self._usable():
            record = await self._probe(name)
        if record is None:
            self._count("misses")
            return None
        if not self._usable():
            self._count("misses", "misses_unhealthy")
            return None
        with self._index.lock:
            record.readers += 1
        try:
            if record.header is None:
                try:
                    await self._workers.run(self._learn_header, name, record)
                except TierClosed:
                    return None
            header = record.header
            if header is None or header.key != key:
                self._count("misses")
                return None
            buf = alloc(header.body_len)  # may raise NoSpace: nothing to undo
            try:
                ok = await self._workers.run(self._read_body, name, record, header, buf)
            except TierClosed:
                return None
        finally:
            self._reader_done(name, record)
        if not ok:
            return None
        self._count("hits")
        self._index.touch(name)
        return header.meta

    async def delete(self, key: str) -> bool:
        if self._closed:
            return False
        name = object_name(key)
        record = self._index.remove(name)
        if record is None:
            return False
        self._doom(name)
        self._count("deletes")
        self._discard(name, record)
        return True

    # -- writes: the worker and batcher side -----------------------------------------------

    def _spool(self, key: str, data: memoryview, meta: ObjectMeta) -> tuple[str, _diskfile.Header]:
        """Write the object (header + body) to a spool file; ValueError for metadata the
        format cannot hold."""
        header, _ = encode_header(key, data, meta, time.time_ns())
        path = os.path.join(self._cache_dir, f"up-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _diskfile.write_object(fd, header, data)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            raise
        os.close(fd)
        return path, _diskfile.decode_header(header)

    def _run_batch(self, jobs: list[_Job]) -> None:
        """The batcher thread: one commit, then reconcile every path it touched."""
        client = self._client
        assert client is not None
        adds = [j for j in jobs if isinstance(j, _Add)]
        deletes = [j for j in jobs if isinstance(j, _Delete) and self._still_doomed(j)]
        skipped = [j for j in jobs if isinstance(j, _Delete) and j not in deletes]
        for job in skipped:
            self._forget(job.name, job.record)
        if not adds and not deletes:
            return
        error: HubError | None = None
        rejected: dict[str, str] = {}
        try:
            client.batch([(j.spool, j.path) for j in adds], [j.path for j in deletes])
        except HubError as exc:
            error = exc
            rejected = getattr(exc, "failed", {})
        found: dict[str, FileInfo] | None
        try:
            found = client.paths_info([j.path for j in jobs])
        except HubError as exc:
            found = None
            error = error or exc
        with self._mu:
            self._counters["batches"] += 1
            if rejected:
                self._counters["batch_partial"] += 1
        # Health first: a caller told its write failed must already see the tier unhealthy.
        if error is not None and not (rejected and found is not None):
            self._failed(error, "hf tier: batch commit failed")
        elif found is not None:
            self._succeeded()
        for add in adds:
            info = found.get(add.path) if found is not None else None
            ok = info is not None and add.path not in rejected and info.size == add.record.size
            if ok:
                assert info is not None
                add.record.xet_hash = info.xet_hash
                if error is not None:
                    self._count("reconciled")
            self._finish_add(add, ok, resolve=False)
        for delete in deletes:
            if found is None or delete.path in found:
                self._count("delete_failures")
            self._forget(delete.name, delete.record)
        if rejected:
            self._warn("hf tier: the Hub rejected part of a batch", rejected=len(rejected))
        self._watermark()  # before the writers hear back, so they see usage settled
        for add in adds:
            add.future.set_result(add.record.committed > 0)

    def _finish_add(self, job: _Add, ok: bool, *, resolve: bool = True) -> None:
        with contextlib.suppress(OSError):
            os.unlink(job.spool)
        size = job.record.size
        if ok:
            job.record.committed = time.monotonic()
            self._index.commit(job.name, job.record, size)
            self._count("puts")
        else:
            self._index.cancel(size)
            self._count("write_failures")
        self._write_done(job.name, size)
        if resolve:
            job.future.set_result(ok)

    def _write_done(self, name: str, size: int) -> None:
        with self._mu:
            self._pending_bytes -= size
            left = self._writing.get(name, 0) - 1
            if left > 0:
                self._writing[name] = left
            else:
                self._writing.pop(name, None)

    def _still_doomed(self, job: _Delete) -> bool:
        """Delete only if no newer version of the name is indexed or being written (a
        newer object overwrites the path in place; deleting would remove it)."""
        with self._mu:
            if job.name in self._writing:
                return False
        return job.name not in self._index

    # -- eviction and deletion -------------------------------------------------------------

    def _watermark(self) -> None:
        if not self.capacity:
            return
        index = self._index
        if index.bytes < self.opts.trigger * self.capacity:
            return
        target = (self.opts.trigger - self.opts.ratio) * self.capacity
        victims = []
        for name, record in index.lru_order():
            if index.bytes <= target:
                break
            if index.remove(name, record) is not None:
                victims.append((name, record))
        self._evicted(victims, doomed=True)

    def _evicted(self, victims: Iterable[tuple[str, _Obj]], *, doomed: bool = False) -> None:
        """Evicted objects stay in the bucket until handed off and released, or deleted: their
        bytes are held until then (``doomed``: ``LRUIndex.remove`` booked them already)."""
        for name, record in victims:
            self._count("evictions")
            self._doom(name)
            if not doomed:
                self._index.hold(record.size)
            header = record.header
            if header is not None and record.key is not None and record.xet_hash:
                self.hand_off(HFVictim(self, name, record, header))
            else:  # a key we never learned cannot be demoted: drop it
                self._discard(name, record)

    def _discard(self, name: str, record: _Obj) -> None:
        """Delete an object that left the index (its bytes are doomed until deleted)."""
        with self._index.lock:
            if record.readers:
                record.discard = True
                return
            record.discard = False
        batcher = self._batcher
        if batcher is None or self._closed:
            self._forget(name, record)
            return
        try:
            batcher.submit(_Delete(name, self.handle.path_of(name), record))
        except RuntimeError:
            self._forget(name, record)

    def _doom(self, name: str) -> None:
        """``name`` left the index but its object is still in the bucket (held for
        demotion, or its delete not yet committed): a listing must not take it back."""
        with self._mu:
            self._doomed_names[name] = self._doomed_names.get(name, 0) + 1

    def _forget(self, name: str, record: _Obj) -> None:
        """The doomed object is gone from the bucket (or was never going to be deleted)."""
        self._index.forget(record.size)
        with self._mu:
            left = self._doomed_names.get(name, 0) - 1
            if left > 0:
                self._doomed_names[name] = left
            else:
                self._doomed_names.pop(name, None)

    def _reader_done(self, name: str, record: _Obj) -> None:
        with self._index.lock:
            record.readers -= 1
            discard = record.readers == 0 and record.discard
        if discard:
            self._discard(name, record)

    # -- reads: the worker side ------------------------------------------------------------

    async def _probe(self, name: str) -> _Obj | None:
        """Look in the bucket for an object another server wrote since the last listing."""
        if not self._probes.enter():
            self._count("probes_skipped")
            return None
        try:
            return await self._workers.run(self._probe_sync, name)
        except TierClosed:
            return None
        finally:
            self._probes.leave()

    def _probe_sync(self, name: str) -> _Obj | None:
        client = self._client
        assert client is not None
        with self._mu:  # a name this server is writing or deleting is its own to settle
            if name in self._writing or name in self._doomed_names:
                return None
            self._counters["probes"] += 1
        path = self.handle.path_of(name)
        try:
            info = client.paths_info([path]).get(path)
        except HubError as exc:
            self._probes.failed()
            self._failed(exc, "hf tier: probe failed; served as a miss")
            return None
        if info is None:
            return None
        record = _Obj(info.size, info.xet_hash, committed=time.monotonic())
        if self._index.adopt(name, record) is not record:
            return self._index.get(name)  # indexed meanwhile (a listing, a write)
        self._evicted(self._index.overflow())
        self._watermark()
        self._count("probe_hits")
        return record

    def _info(self, name: str, record: _Obj) -> FileInfo:
        from .client import FileInfo

        return FileInfo(self.handle.path_of(name), record.size, record.xet_hash, 0.0)

    def _learn_header(self, name: str, record: _Obj) -> None:
        """Read the header of an object another instance wrote (one small range read)."""
        client = self._client
        assert client is not None
        buf = bytearray(min(record.size, _diskfile.MAX_HEADER))
        try:
            got = client.read_into(self._info(name, record), 0, memoryview(buf))
            header = _diskfile.decode_header(memoryview(buf)[:got])
        except HubError as exc:
            self._read_failed(name, record, exc)
            return
        except _diskfile.CorruptFile:
            self._drop(name, record, "corrupt")
            return
        if object_name(header.key) != name or header.size != record.size:
            self._drop(name, record, "corrupt")
            return
        with self._index.lock:
            record.header = header
            record.key = header.key

    def _read_body(self, name: str, record: _Obj, header: _diskfile.Header, buf: memoryview) -> bool:
        client = self._client
        assert client is not None
        try:
            got = client.read_into(self._info(name, record), header.header_len, buf)
        except HubError as exc:
            self._read_failed(name, record, exc)
            return False
        if got != header.body_len or _diskfile.checksum(buf) != header.body_crc:
            self._drop(name, record, "corrupt")
            return False
        self._succeeded()
        return True

    def _read_failed(self, name: str, record: _Obj, exc: HubError) -> None:
        if exc.kind == "not_found":
            self._drop(name, record, "missing")
            return
        self._count("misses", "read_errors")
        self._failed(exc, "hf tier: read failed; served as a miss")

    def _drop(self, name: str, record: _Obj, reason: str) -> None:
        """A missing or corrupt object: a counted miss; the index forgets it (and a corrupt
        object is deleted from the bucket)."""
        self._count("misses", reason)
        self._warn(f"hf tier: {reason} object dropped", name=name)
        if reason == "corrupt":
            if self._index.remove(name, record) is not None:
                self._doom(name)
                self._discard(name, record)
        else:
            self._index.remove(name, record, doom=False)

    def read_whole(self, name: str, record: _Obj, header: _diskfile.Header) -> memoryview:
        """Download and verify a whole object (for demotion); raises TierError."""
        client = self._client
        if client is None or self._closed:
            raise TierError("hf tier is closed")
        buf = bytearray(record.size)
        try:
            got = client.read_into(self._info(name, record), 0, memoryview(buf))
        except HubError as exc:
            raise TierError(str(exc)) from exc
        body = memoryview(buf)[header.header_len :]
        if got != record.size or _diskfile.checksum(body) != header.body_crc:
            raise TierError(f"hf tier: object {name} failed verification")
        return body

    # -- index from the bucket -------------------------------------------------------------

    def _sync_listing(self) -> None:
        """List the bucket and make the index match it (objects others wrote or deleted)."""
        client = self._client
        assert client is not None
        started = time.monotonic()
        seen: dict[str, FileInfo] = {}
        for info in client.listing(self.handle.prefix):
            name = self.handle.name_of(info.path)
            if name is None:
                continue
            seen[name] = info
            if len(seen) % _PROGRESS_EVERY == 0:
                log.info("hf tier: listing bucket", bucket=str(self.handle), objects=len(seen))
        index = self._index
        learned = removed = 0
        with self._mu:  # names being written or deleted are this server's to settle
            writing = set(self._writing) | set(self._doomed_names)
        for name, info in sorted(seen.items(), key=lambda item: item[1].mtime):  # oldest first = LRU
            record = index.get(name)
            if name in writing:
                continue
            if record is None or (record.xet_hash != info.xet_hash and record.committed < started):
                if record is not None:
                    index.remove(name, record, doom=False)
                index.load(name, _Obj(info.size, info.xet_hash, committed=started))
                learned += 1
        if self._listed:
            for name, record in index.lru_order():
                gone = name not in seen and name not in writing and record.committed < started
                if gone and index.remove(name, record, doom=False) is not None:
                    removed += 1
        else:
            log.info(
                "hf tier: bucket listed",
                bucket=str(self.handle),
                objects=len(seen),
                bytes=sum(i.size for i in seen.values()),
                seconds=round(time.monotonic() - started, 3),
            )
        self._listed = True
        with self._mu:
            self._counters["refreshes"] += 1
            self._counters["learned_from_bucket"] += learned
            self._counters["removed_by_others"] += removed
        self._evicted(index.overflow())
        self._watermark()
        self._succeeded()

    def _learn_some_headers(self) -> None:
        """Learn the keys of up to a few hundred objects others wrote (for LIST)."""
        unknown = [(n, r) for n, r in self._index.lru_order() if r.header is None][:_HEADERS_PER_ROUND]
        for name, record in unknown:
            if self._stop.is_set() or not self._usable():
                return
            self._learn_header(name, record)

    def _refresh_loop(self) -> None:
        next_listing = time.monotonic() + self.opts.refresh_s if self._listed else 0.0
        while not self._stop.wait(0.2 if not self._healthy else min(1.0, self.opts.refresh_s or 1.0)):
            try:
                if not self._healthy:
                    if time.monotonic() < self._retry_at:
                        continue
                    assert self._client is not None
                    if self._listed:
                        self._client.probe()
                    else:  # unreachable at start: the bucket may still need creating
                        self._client.ensure_bucket(create=self.opts.create, private=self.opts.private)
                    self._succeeded()
                now = time.monotonic()
                if not self._listed or (self.opts.refresh_s and now >= next_listing):
                    self._sync_listing()
                    next_listing = time.monotonic() + self.opts.refresh_s
                if self.opts.learn_keys:
                    self._learn_some_headers()
            except HubError as exc:
                self._failed(exc, "hf tier: bucket refresh failed")
            except Exception as exc:  # never let the thread die silently
                self._warn("hf tier: refresh error", error=repr(exc))

    # -- health and counters ---------------------------------------------------------------

    def _usable(self) -> bool:
        return self._healthy or time.monotonic() >= self._retry_at

    def _failed(self, exc: HubError, event: str) -> None:
        with self._mu:
            self._counters["failures"] += 1
            self._consecutive += 1
            backoff = min(_MAX_BACKOFF_S, 0.5 * 2 ** min(self._consecutive, 8))
            if exc.retry_after is not None:
                backoff = max(backoff, exc.retry_after)
            self._retry_at = time.monotonic() + backoff
            self._healthy = False
        self._warn(event, kind=exc.kind, status=exc.status, error=str(exc), retry_in_s=round(backoff, 1))

    def _attempt_failed(self, exc: HubError) -> None:
        """An HTTP attempt could not reach the Hub while its call retries (client.py): stop
        taking writes now, not when the retries give up ~23 s later. Counted as one failure
        while healthy only: the retries that follow are the same trouble, and the call's
        outcome is counted as ever. The refresh thread's probe makes the tier healthy again."""
        with self._mu:
            if not self._healthy:
                return
        self._failed(exc, "hf tier: the Hub is unreachable; retrying")

    def _succeeded(self) -> None:
        with self._mu:
            was = self._healthy
            self._healthy = True
            self._consecutive = 0
        if not was:
            log.info("hf tier: bucket reachable again", bucket=str(self.handle))

    def _count(self, *names: str) -> None:
        with self._mu:
            for name in names:
                self._counters[name] += 1

    def _warn(self, event: str, **kw: Any) -> None:
        self._warnings.warning(event, bucket=str(self.handle), **kw)


class HFVictim(Victim):
    """An object evicted from the bucket tier, kept until the Store has demoted it."""

    __slots__ = ("_done", "_header", "_name", "_record", "_tier")

    def __init__(self, tier: HFBucketTier, name: str, record: _Obj, header: _diskfile.Header) -> None:
        super().__init__(header.key, header.body_len, header.meta)
        self._tier = tier
        self._name = name
        self._record = record
        self._header = header
        self._done = False

    def open(self) -> memoryview:
        return self._tier.read_whole(self._name, self._record, self._header)

    def release(self) -> None:
        if self._done:
            return
        self._done = True
        self._tier._discard(self._name, self._record)
