"""LMCache multi-process mode: lmserver as an L2 adapter, loaded through ``--l2-adapter``.

``lmcache server`` (LMCache 0.5.x) keeps the engine's L1 in host memory and stores through
L2 adapters; this one stores in one or more lmservers (``import lmclient`` never imports
LMCache; only LMCache imports this module)::

    lmcache server --l1-size-gb 20 --eviction-policy LRU --l2-adapter \\
      '{"type":"plugin","module_path":"lmclient.lmcache_mp","class_name":"LMServerL2Adapter",
        "adapter_params":{"url":"lm://10.0.0.1:65432,10.0.0.2:65432"},"shared":true}'

Parameters (``adapter_params``; LMServerL2AdapterConfig checks them when the server starts):

- ``url`` (required): ``lm://host:port[,host:port...]`` or ``lms://`` (TLS, system CAs);
  several servers place keys by rendezvous hashing.
- ``timeout`` (5): seconds one wait for the network may take (connect: at most 2).
- ``task_timeout`` (10): seconds one task (store, lookup, load, delete, listing) may take
  in all; it then completes as a failure.
- ``max_connections`` (1): connections per server for stores, and as many for loads (each
  key uses one, its lane); lookups, deletes, HEALTH and listings have one more of their own.
  More than one helps only where one TCP stream cannot fill the link: on loopback each one
  added cost CPU per object (256 KiB chunks: 1.7 / 1.35 / 1.1 GB/s with 1 / 2 / 4).
- ``retries`` (1): immediate reconnect-and-retry attempts before a server counts as down.
- ``capacity_bytes`` (0): the capacity LMCache's own L2 eviction sees (with ``"eviction"``
  in the JSON); 0 leaves eviction to lmserver (its LRU and ``--memory-limit``).
- ``health_interval`` (1): seconds between HEALTH probes of every server.

Strategy: one asyncio loop on a thread of its own carries every task, through three
`AsyncClient`s: one for stores, one for loads, one (a single connection per server) for
lookups, deletes, HEALTH and listings, so none queues behind another's 32 MiB transfers.
``submit_*`` only schedules a coroutine there and returns its task id. Each coroutine is
bounded by ``task_timeout`` and always completes: it publishes its result, then signals its
eventfd. Stores are PUT_ACKs pipelined per connection (a refusal, 413 or 507, is a failure,
never a false success), straight from the L1 buffer; lookups are one EXIST_MANY per server;
deletes one DELETE_MANY per server; loads are GETs received straight into the L1 staging buffers
(a reply whose length or layout differs from the buffer is drained: a miss). Batch results
come per key (``return_exceptions``), so one key's failure never hides the others'. A
server that fails is skipped for a backoff period (its keys miss, its stores fail at once)
and tried again after it; ``report_status`` says unhealthy while any server is down. A task
that times out closes the connections its keys use before it completes: LMCache reuses the
buffers once told, and nothing may touch them afterwards.

The lock of ``submit_lookup_and_lock_task`` is client-side (lmserver has none): a key this
adapter found stays out of its own ``delete`` (LMCache's eviction) until unlocked; such a
delete is carried out at the last unlock. lmserver's own eviction can still remove it, and
its load then misses. Keys follow protocol/SPEC.md 5.1.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, ClassVar, TypeVar

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier
from lmcache.v1.protocol import DTYPE_TO_INT

from lmproto import KEY_SIZE, ObjectMeta, Reply

from ._async import AsyncClient
from ._config import Retry, Timeout, parse_servers, url_wants_tls
from ._exceptions import BufferTooSmall, LMClientError, ReadError, TensorMismatch
from ._failures import FailureLog
from ._l2keys import KeyFields, object_name, parse_name
from ._ops import Batch, Flow, Op
from ._wire import Received, readable_view, writable_view

__all__ = ["LMServerL2Adapter", "LMServerL2AdapterConfig", "adapter_spec"]

T = TypeVar("T")
log = logging.getLogger("lmclient.lmcache_mp")

CLOSE_TIMEOUT = 5.0
"""Seconds ``close`` waits for the loop thread to finish."""


# ---------------------------------------------------------------------------------------
# configuration


class LMServerL2AdapterConfig(L2AdapterConfigBase):  # type: ignore[misc]
    """The adapter's ``adapter_params``, checked when LMCache builds the adapter."""

    FIELDS: ClassVar[dict[str, tuple[type, Any]]] = {
        "url": (str, None),
        "timeout": (float, 5.0),
        "task_timeout": (float, 10.0),
        "max_connections": (int, 1),
        "retries": (int, 1),
        "capacity_bytes": (int, 0),
        "health_interval": (float, 1.0),
    }

    def __init__(
        self,
        url: str,
        timeout: float = 5.0,
        task_timeout: float = 10.0,
        max_connections: int = 1,
        retries: int = 1,
        capacity_bytes: int = 0,
        health_interval: float = 1.0,
    ) -> None:
        self.url = url
        self.timeout = timeout
        self.task_timeout = task_timeout
        self.max_connections = max_connections
        self.retries = retries
        self.capacity_bytes = capacity_bytes
        self.health_interval = health_interval

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LMServerL2AdapterConfig:
        """Raises ValueError naming the parameter for anything unknown, missing or out of range."""
        unknown = sorted(set(d) - set(cls.FIELDS) - {"type"})
        if unknown:
            raise ValueError(
                f"unknown lmserver L2 adapter parameter(s) {unknown}; known: {sorted(cls.FIELDS)}"
            )
        values: dict[str, Any] = {}
        for name, (kind, default) in cls.FIELDS.items():
            value = d.get(name, default)
            if value is None:
                raise ValueError(f'lmserver L2 adapter: {name!r} is required (e.g. "lm://127.0.0.1:65432")')
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise ValueError(f"lmserver L2 adapter: {name!r} must be a {kind.__name__}, not {value!r}")
            values[name] = value
        try:
            parse_servers(values["url"])
        except LMClientError as exc:
            raise ValueError(f"lmserver L2 adapter: bad 'url' {values['url']!r}: {exc}") from None
        for name in ("timeout", "task_timeout", "health_interval"):
            if not values[name] > 0:
                raise ValueError(f"lmserver L2 adapter: {name!r} must be > 0, not {values[name]}")
        for name, least in (("max_connections", 1), ("retries", 0), ("capacity_bytes", 0)):
            if values[name] < least:
                raise ValueError(f"lmserver L2 adapter: {name!r} must be >= {least}, not {values[name]}")
        return cls(**values)

    @classmethod
    def help(cls) -> str:
        return (
            "lmserver L2 adapter (lmclient.lmcache_mp.LMServerL2Adapter) adapter_params:\n"
            "- url (str, required): lm://host:port[,host:port...] or lms://...\n"
            "- timeout (float, 5): seconds one network wait may take\n"
            "- task_timeout (float, 10): seconds one store/lookup/load/delete may take\n"
            "- max_connections (int, 1): store and load connections per server, each\n"
            "- retries (int, 1): reconnect-and-retry attempts before a server counts as down\n"
            "- capacity_bytes (int, 0): capacity for LMCache-side eviction (0: lmserver evicts)\n"
            "- health_interval (float, 1): seconds between HEALTH probes"
        )


def adapter_spec(url: str, *, shared: bool = True, **params: Any) -> dict[str, Any]:
    """The ``--l2-adapter`` JSON object (as a dict: ``json.dumps`` it) that loads this
    adapter for ``url`` with ``params`` (see the module docstring). ``shared``: one lmserver
    pool serves several LMCache servers. Add ``"eviction"`` (LMCache's L2 eviction, with
    ``capacity_bytes``) to the dict if wanted."""
    return {
        "type": "plugin",
        "module_path": __name__,
        "class_name": LMServerL2Adapter.__name__,
        "adapter_params": {"url": url, **params},
        "shared": shared,
    }


# ---------------------------------------------------------------------------------------
# buffers and keys


def _fields(key: ObjectKey) -> KeyFields:
    return KeyFields(key.chunk_hash, key.model_name, key.kv_rank, key.object_group_id, key.cache_salt)


def _meta(obj: MemoryObj) -> ObjectMeta:
    """The v1 meta stored with an object: its format, and dtype and shape where it has one
    tensor of at most 4 dimensions (else 0s: such layouts are checked by size alone). Read
    from ``obj.meta``: the accessors take the object's lock, which cost ~0.1 ms per object
    on a busy host (a GIL hand-off), more than sending a 256 KiB chunk."""
    meta = obj.meta
    shapes = meta.shapes or [meta.shape]
    dtypes = meta.dtypes or [meta.dtype]
    return _layout_meta(int(meta.fmt.value), tuple(tuple(int(n) for n in s) for s in shapes), tuple(dtypes))


@functools.lru_cache(maxsize=64)
def _layout_meta(fmt: int, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[Any, ...]) -> ObjectMeta:
    if len(shapes) == 1 and len(dtypes) == 1 and len(shapes[0]) <= 4:
        shape = (*shapes[0], 0, 0, 0, 0)
        return ObjectMeta(fmt, DTYPE_TO_INT.get(dtypes[0], 0), (shape[0], shape[1], shape[2], shape[3]))
    return ObjectMeta(fmt, 0, (0, 0, 0, 0))


class _Target:
    """Where one load lands: the L1 staging buffer, if the stored object fits it exactly."""

    __slots__ = ("meta", "refused", "view")

    def __init__(self, obj: MemoryObj) -> None:
        self.view = writable_view(obj.byte_array)
        self.meta = _meta(obj)
        self.refused = False

    def __call__(self, reply: Reply) -> memoryview | LMClientError:
        stored = reply.meta
        if reply.length != len(self.view):
            self.refused = True
            return BufferTooSmall(reply.length, len(self.view), "the stored object's size differs")
        if (stored.dtype and stored.dtype != self.meta.dtype) or (
            any(stored.shape) and stored.shape != self.meta.shape
        ):
            self.refused = True
            return TensorMismatch(f"stored layout {stored} differs from {self.meta}")
        return self.view


def _loaded(received: Received) -> bool:
    return True


def _together(batches: list[Batch]) -> Flow[list[list[Any]]]:
    """A flow that runs ``batches`` concurrently and returns each one's results."""
    return (yield batches)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------------
# the adapter


class _Results:
    """One kind of task's completions: published under a lock, then its eventfd signalled."""

    def __init__(self) -> None:
        self.notifier = create_event_notifier()
        self.done: dict[int, Any] = {}

    def fileno(self) -> int:
        return int(self.notifier.fileno())


class LMServerL2Adapter(L2AdapterInterface):  # type: ignore[misc]
    """L2 adapter storing in lmserver; see the module docstring."""

    config_class_name = "LMServerL2AdapterConfig"

    def __init__(
        self, config: LMServerL2AdapterConfig | dict[str, Any], l1_memory_desc: Any = None, **_: Any
    ) -> None:
        if not isinstance(config, LMServerL2AdapterConfig):
            config = LMServerL2AdapterConfig.from_dict(dict(config))
        super().__init__(config.capacity_bytes)
        self.config = config
        self._task_timeout = config.task_timeout
        self._stores, self._lookups, self._loads = _Results(), _Results(), _Results()
        self._lock = threading.Lock()  # results, locks, sizes, task ids
        self._ids = itertools.count()
        self._locks: Counter[str] = Counter()  # name -> lookups not yet unlocked
        self._deferred: dict[str, ObjectKey] = {}  # deletes waiting for their key's unlock
        self._sizes: dict[str, int] = {}  # name -> bytes, for keys this adapter accounted
        self._pending = 0  # tasks submitted and not yet completed
        self._failures = FailureLog(log, "lmserver L2")
        self._counts: Counter[str] = Counter()
        self._healthy: list[bool] = []
        self._probed = 0.0
        self._closed = False
        self._loop = self._new_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="lmserver-l2", daemon=True)
        self._thread.start()
        # Stores and loads each have connections of their own (a prefetch's loads never queue
        # behind a stream of 32 MiB stores, nor the reverse: a key is loaded only after its
        # store was acknowledged, so the two need no common order); lookups, deletes, HEALTH
        # and listings go on ``control``'s one connection per server, behind neither.
        self.storing: AsyncClient = self._on_loop(self._make_client(config.max_connections), CLOSE_TIMEOUT)
        self.loading: AsyncClient = self._on_loop(self._make_client(config.max_connections), CLOSE_TIMEOUT)
        self.control: AsyncClient = self._on_loop(self._make_client(1), CLOSE_TIMEOUT)
        self._clients = (self.storing, self.loading, self.control)
        self._probe = asyncio.run_coroutine_threadsafe(self._probe_forever(), self._loop)
        log.info("lmserver L2 adapter: %s (task timeout %.1fs)", config.url, config.task_timeout)

    @staticmethod
    def _new_loop() -> asyncio.AbstractEventLoop:
        try:
            import uvloop
        except ImportError:
            return asyncio.new_event_loop()
        return uvloop.new_event_loop()

    async def _make_client(self, connections: int) -> AsyncClient:
        c = self.config
        return AsyncClient(
            servers=parse_servers(c.url),
            timeout=Timeout(c.timeout, connect=min(2.0, c.timeout)),
            retry=Retry(retries=c.retries, base=0.05, cap=0.5),
            max_connections=connections,
            skip_down=True,  # a server that fails is skipped (its keys miss) and tried again later
            ssl=True if url_wants_tls(c.url) else None,
        )

    def __repr__(self) -> str:
        return f"<LMServerL2Adapter {self.config.url}>"

    # -- event fds ----------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._stores.fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookups.fileno()

    def get_load_event_fd(self) -> int:
        return self._loads.fileno()

    # -- tasks: scheduled on the loop, bounded, always completed ---------------------------

    def _submit(
        self,
        results: _Results,
        work: Callable[[list[str]], Awaitable[Any]],
        failure: Any,
        carrier: AsyncClient | None = None,
    ) -> L2TaskId:
        """Schedule ``work`` on the loop and return its task id at once: everything else
        (keys, requests) happens on the loop thread, so the caller's thread (a storage
        controller's) and the loop's do not contend for the GIL. ``carrier``: the client whose
        connections carry the task's L1 buffers."""
        with self._lock:
            task_id = next(self._ids)
            self._pending += 1
        if not self._spawn(self._bounded(results, task_id, work, failure, carrier)):
            self._complete(results, task_id, failure)  # closed: completed at once, unsignalled
        return task_id

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> bool:
        """Schedule ``coro`` on the loop; False (and ``coro`` dropped) once closed."""
        try:
            if not self._closed:
                asyncio.run_coroutine_threadsafe(coro, self._loop)
                return True
        except RuntimeError:  # the loop closed meanwhile
            pass
        coro.close()
        return False

    async def _bounded(
        self,
        results: _Results,
        task_id: int,
        work: Callable[[list[str]], Awaitable[Any]],
        failure: Any,
        carrier: AsyncClient | None,
    ) -> None:
        """Run ``work``, which lists in its argument the keys whose requests on ``carrier``
        reference L1 buffers; bounded by the task timeout, and completed whatever happens."""
        outcome, touched = failure, list[str]()
        try:
            async with asyncio.timeout(self._task_timeout):
                outcome = await work(touched)
        except TimeoutError as exc:
            self._abandon(carrier, touched)
            self._failures.record("task (timed out)", exc)
        except Exception as exc:  # a bug or an unexpected error: still a completed task
            self._abandon(carrier, touched)
            self._failures.record("task", exc)
        finally:
            self._complete(results, task_id, outcome)

    def _complete(self, results: _Results, task_id: int, outcome: Any) -> None:
        with self._lock:
            results.done[task_id] = outcome
            self._pending -= 1
            if not self._closed:  # a closed eventfd's number may already name another file
                results.notifier.notify()  # after publishing: the controller reads once woken

    def _abandon(self, carrier: AsyncClient | None, names: Sequence[str]) -> None:
        """Close the connections of ``carrier`` that carry ``names``: their requests may still
        reference L1 buffers, which LMCache reuses once the task completes (on the loop, so
        nothing runs between this and the completion)."""
        if carrier is None:
            return
        placement = carrier._placement
        for server, lane in {(placement.server(n), placement.lane(n)) for n in names}:
            conn = carrier._lanes[server][lane]
            if conn is not None:
                conn.close(ReadError("an L2 task timed out; its connection is abandoned"))

    def _take(self, results: _Results, task_id: L2TaskId) -> Any:
        with self._lock:
            return results.done.pop(task_id, None)

    # -- store ----------------------------------------------------------------------------

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        work = functools.partial(self._store, keys, objects)
        return self._submit(self._stores, work, L2StoreResult(False, 0), self.storing)

    async def _store(
        self, keys: list[ObjectKey], objects: list[MemoryObj], names: list[str]
    ) -> L2StoreResult:
        """``names``: filled with the keys' names first (see `_bounded`)."""
        names += [object_name(_fields(k)) for k in keys]
        views = [readable_view(obj.byte_array) for obj in objects]
        put = self.storing._commands.put
        ops: list[Op[Any]] = [
            put(name, view, _meta(obj), True) for name, view, obj in zip(names, views, objects, strict=True)
        ]
        outcomes = await self.storing._call(self.storing._grouped(ops, settle=True))
        stored = [i for i, outcome in enumerate(outcomes) if outcome is None]
        failed = [outcome for outcome in outcomes if outcome is not None]
        if failed:
            self._failures.record("store", failed[0], len(failed))
        self._count(stored_keys=len(stored), store_failures=len(failed))
        self._account([keys[i] for i in stored], [names[i] for i in stored], [len(views[i]) for i in stored])
        return L2StoreResult(not failed, sum(len(views[i]) for i in stored))

    def _account(self, keys: list[ObjectKey], names: list[str], sizes: list[int]) -> None:
        """Report newly stored keys to LMCache's accounting (a key stored again counts once)."""
        with self._lock:
            new = [i for i, name in enumerate(names) if name not in self._sizes]
            for i in new:
                self._sizes[names[i]] = sizes[i]
        if new:
            self._notify_keys_stored([keys[i] for i in new], [sizes[i] for i in new])

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._stores.done = self._stores.done, {}
        return done

    # -- lookup and lock ------------------------------------------------------------------

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit(self._lookups, lambda _: self._lookup(keys), Bitmap(len(keys)))

    async def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        names = [object_name(_fields(k)) for k in keys]
        # One EXIST_MANY per server, on the control connection: one round trip, never
        # behind a load. Stores are acknowledged before their task completes, so a lookup
        # needs no ordering with the keys' lanes to see them.
        placement, commands = self.control._placement, self.control._commands
        by_server: dict[int, list[int]] = {}
        for index, name in enumerate(names):
            by_server.setdefault(placement.server(name), []).append(index)
        batches = [
            Batch(commands.exist_many([names[i] for i in indexes]), server=server, settle=True)
            for server, indexes in by_server.items()
        ]
        parts = await self.control._call(_together(batches))
        hits = [False] * len(names)
        for indexes, part in zip(by_server.values(), parts, strict=True):
            answers = [hit for chunk in part if isinstance(chunk, list) for hit in chunk]
            if len(answers) == len(indexes):  # else that server failed: its keys miss
                for index, hit in zip(indexes, answers, strict=True):
                    hits[index] = hit
        bitmap = Bitmap(len(names))
        with self._lock:
            for i, hit in enumerate(hits):
                if hit:
                    bitmap.set(i)
                    self._locks[names[i]] += 1
        self._count(lookups=len(names), lookup_hits=sum(hits))
        return bitmap

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._lookups, task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        released: list[tuple[str, ObjectKey]] = []
        with self._lock:
            for key in keys:
                name = object_name(_fields(key))
                if self._locks[name] <= 1:
                    self._locks.pop(name, None)
                    if name in self._deferred:
                        released.append((name, self._deferred.pop(name)))
                else:
                    self._locks[name] -= 1
        if released:
            self._spawn(self._delete_bounded(released))

    # -- load -------------------------------------------------------------------------------

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        work = functools.partial(self._load, keys, objects)
        return self._submit(self._loads, work, Bitmap(len(keys)), self.loading)

    async def _load(self, keys: list[ObjectKey], objects: list[MemoryObj], names: list[str]) -> Bitmap:
        """``names``: filled with the keys' names first (see `_bounded`)."""
        names += [object_name(_fields(k)) for k in keys]
        targets = [_Target(obj) for obj in objects]
        get_with = self.loading._commands.get_with
        ops: list[Op[Any]] = [
            get_with(name, target, _loaded) for name, target in zip(names, targets, strict=True)
        ]
        outcomes = await self.loading._call(self.loading._grouped(ops, settle=True))
        bitmap = Bitmap(len(keys))
        errors = [outcome for outcome in outcomes if isinstance(outcome, LMClientError)]
        for i, outcome in enumerate(outcomes):
            if outcome is True:
                bitmap.set(i)
        if errors:
            self._failures.record("load", errors[0], len(errors))
        refused = sum(target.refused for target in targets)
        hits = bitmap.popcount()
        self._count(loaded_keys=hits, load_misses=len(keys) - hits, load_refused_layout=refused)
        if hits:
            self._notify_keys_accessed([keys[i] for i in bitmap.get_indices_list()])
        return bitmap

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._take(self._loads, task_id)

    # -- delete (synchronous: LMCache's eviction thread and HTTP) --------------------------

    def delete(self, keys: list[ObjectKey]) -> None:
        """Delete ``keys`` (a key locked by a lookup: at its last unlock). Never raises:
        a failure is logged and counted, and the keys stay accounted."""
        now: list[tuple[str, ObjectKey]] = []
        with self._lock:
            for key in keys:
                name = object_name(_fields(key))
                if self._locks[name]:
                    self._deferred[name] = key
                else:
                    now.append((name, key))
        if not now or self._closed:
            return
        try:
            self._on_loop(self._delete_bounded(now), self._task_timeout + CLOSE_TIMEOUT)
        except Exception as exc:
            self._failures.record("delete", exc, len(now))

    async def _delete_bounded(self, targets: list[tuple[str, ObjectKey]]) -> None:
        names = [name for name, _ in targets]
        try:
            async with asyncio.timeout(self._task_timeout):
                outcomes = await self.control.delete_many(names, return_exceptions=True)
        except TimeoutError as exc:
            self._failures.record("delete (timed out)", exc, len(names))
            return
        gone = [i for i, outcome in enumerate(outcomes) if isinstance(outcome, bool)]
        failed = [outcome for outcome in outcomes if isinstance(outcome, LMClientError)]
        if failed:
            self._failures.record("delete", failed[0], len(failed))
        with self._lock:  # deleted, or already gone: either way no longer held
            sizes = [self._sizes.pop(names[i], 0) for i in gone]
        self._count(deleted_keys=sum(outcomes[i] is True for i in gone))
        if gone:
            self._notify_keys_deleted([targets[i][1] for i in gone], sizes)

    # -- listing ------------------------------------------------------------------------------

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """A page of this pool's keys (of ``model_name``, if given) with their sizes; keys
        in the hashed form (SPEC 5.1) cannot be listed. The cursor is the last key of the
        previous page. Raises ValueError for a bad page size or cursor, and ConnectionError
        when the servers cannot be listed."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive, not {page_size}")
        if cursor is not None and (not cursor or len(cursor.encode("utf-8", "replace")) > KEY_SIZE):
            raise ValueError(f"malformed cursor {cursor!r}")
        prefix = f"{model_name}@" if model_name else ""
        try:
            entries, after = self._on_loop(
                self.control.list_page(prefix, after=cursor or "", limit=page_size), self._task_timeout
            )
        except (LMClientError, TimeoutError, concurrent.futures.TimeoutError) as exc:
            raise ConnectionError(f"lmserver listing failed: {type(exc).__name__}: {exc}") from None
        listed = []
        for name, size in entries:
            fields = parse_name(name)
            if fields is None or object_name(fields) != name:
                continue  # the hashed form, or not this adapter's key
            try:
                key = ObjectKey(*fields)
            except ValueError:
                continue
            with self._lock:
                known = size if size is not None else self._sizes.get(name, 0)
            listed.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=known))
        return KeyListPage(entries=tuple(listed), next_page_token=after)

    # -- status, close --------------------------------------------------------------------------

    async def _probe_forever(self) -> None:
        """HEALTH to every server every ``health_interval`` seconds (bounded by its timeout)."""
        client = self.control
        while True:
            try:
                answers = await client._call(client._everywhere(client._commands.health, self.config.timeout))
            except LMClientError:
                answers = [False] * len(client.settings.servers)
            self._healthy, self._probed = answers, time.monotonic()
            await asyncio.sleep(self.config.health_interval)

    def report_status(self) -> dict[str, Any]:
        now = time.monotonic()
        servers = self.control.settings.servers
        states = [state for client in self._clients for state in client._servers]
        down_now = {str(s.address) for s in states if s.retry_at > now}
        probed = self._healthy if len(self._healthy) == len(servers) else [False] * len(servers)
        fresh = now - self._probed < 3 * self.config.health_interval + self.config.timeout
        state = {
            str(address): ok and str(address) not in down_now and fresh
            for address, ok in zip(servers, probed, strict=True)
        }
        with self._lock:
            pending, locked, deferred = self._pending, len(self._locks), len(self._deferred)
            counts = dict(self._counts)
        return {
            "is_healthy": not self._closed and self._thread.is_alive() and all(state.values()),
            "type": type(self).__name__,
            "url": self.config.url,
            "servers_up": state,
            "pending_tasks": pending,
            "locked_keys": locked,
            "deferred_deletes": deferred,
            "counts": counts,
            "failures": dict(self._failures.counts()),
            "client": dict(sum((Counter(client.counters) for client in self._clients), Counter())),
        }

    def close(self) -> None:
        """Stop every task (closing the connections first, so no buffer is touched after
        this returns), the probe and the loop; close the eventfds. Bounded by CLOSE_TIMEOUT."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._probe.cancel()
        try:
            self._on_loop(self._shutdown(), CLOSE_TIMEOUT)
        except Exception as exc:
            log.warning("lmserver L2 adapter: close did not finish cleanly: %s", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT)
        if not self._thread.is_alive():
            self._loop.close()
        with self._lock:
            for results in (self._stores, self._lookups, self._loads):
                results.notifier.close()
        log.info(
            "lmserver L2 adapter closed: %s; failures %s", dict(self._counts), dict(self._failures.counts())
        )

    async def _shutdown(self) -> None:
        for client in self._clients:
            await client.aclose()  # closes every connection at once, then waits for its reader
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    # -- helpers --------------------------------------------------------------------------------

    def _on_loop(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the adapter's loop from another thread; at most ``timeout`` s."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def _count(self, **increments: int) -> None:
        with self._lock:
            self._counts.update(increments)
