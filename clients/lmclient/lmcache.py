"""LMCache remote-storage plugin: LMCache's `RemoteBackend` talks to lmserver through lmclient.

Load it with LMCache's plugin framework (LMCache 0.5.x); nothing imports this module
except LMCache itself (``import lmclient`` never imports lmcache)::

    remote_storage_plugins: ["lmserver"]
    extra_config:
      remote_storage_plugin.lmserver.module_path: lmclient.lmcache
      remote_storage_plugin.lmserver.class_name: LMServerConnector
      remote_storage_plugin.lmserver.url: lm://10.0.0.1:65432,10.0.0.2:65432

Strategy: one `AsyncClient` on LMCache's event loop (the loop ``RemoteBackend`` runs its
connector coroutines on) carries every call, the synchronous ones (``exists_sync``,
``batched_contains``, ``remove_sync``, which LMCache calls from engine threads) included,
so every call on a key shares the key's connection: a lookup after a store sees it. GET
replies are received straight into the `MemoryObj` that LMCache's allocator hands out
for the reply's shape, dtype and format (no staging copy). A server that fails is skipped
for a backoff period and retried (see lmclient's ``servers``), and every failure reaches
LMCache only as the answer it expects for a miss (False, None, 0, an empty list): each is
counted in `LMServerConnector.errors` (a call that failed, by kind, and ``unavailable``:
operations answered as misses because their server was down) and logged at most once per
``LOG_EVERY`` seconds per kind (the client logs each time it finds a server down).

Options, as ``remote_storage_plugin.<name>.<option>`` in ``extra_config``:

- ``url`` (required; or env ``LMSERVER_URL``): ``lm://host:port[,host:port...]``.
- ``max_connections`` (4): connections per server.
- ``timeout`` (10): seconds one call may take in all: connecting (at most 2 s an attempt),
  retries, their backoff and every wait (lmclient's ``Timeout`` ``total``), so a server that
  is down costs a lookup, store or retrieval at most this, once per skip period.
- ``retries`` (1): immediate reconnect-and-retry attempts before a server counts as down.
- ``put_ack`` (false): store with PUT_ACK (the put coroutine waits for the server).
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import logging
import os
from collections import Counter
from collections.abc import Coroutine
from typing import Any, TypeVar

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.protocol import DTYPE_TO_INT, INT_TO_DTYPE, pad_shape_to_4d, strip_shape_padding
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from lmproto import ObjectMeta, Reply

from ._async import AsyncClient
from ._config import Retry, Timeout, parse_servers
from ._exceptions import BufferTooSmall, InvalidRequest, LMClientError
from ._failures import FailureLog
from ._ops import Op
from ._wire import Received, writable_view

__all__ = ["LMServerConnector", "plugin_settings"]

T = TypeVar("T")
Keys = list[CacheEngineKey]  # named out here: the class's list() method shadows the builtin
Objects = list[MemoryObj]
Found = list[MemoryObj | None]
Strings = list[str]
log = logging.getLogger("lmclient.lmcache")

LOG_EVERY = 30.0
"""Seconds between two log lines about failures of one kind (the rest are counted)."""
SYNC_SLACK = 5.0
"""Seconds a synchronous call waits beyond the client's own deadline before it gives up."""


class _Allocation:
    """The sink of one GET: allocates the MemoryObj the reply's metadata describes and has
    the body received into it. A retried GET frees the previous attempt's object first."""

    __slots__ = ("backend", "obj", "refused")

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.obj: MemoryObj | None = None
        self.refused: LMClientError | None = None  # why the object was drained: a miss

    def __call__(self, reply: Reply) -> memoryview | LMClientError:
        self.release()
        self.refused = self._target(reply)
        if self.refused is not None:
            self.release()
            return self.refused
        assert self.obj is not None
        return writable_view(self.obj.byte_array)

    def _target(self, reply: Reply) -> LMClientError | None:
        meta = reply.meta
        dtype = INT_TO_DTYPE.get(meta.dtype)
        try:
            fmt = MemoryFormat(meta.fmt)
        except ValueError:
            return InvalidRequest(f"the object has an unknown memory format {meta.fmt}")
        if dtype is None:
            return InvalidRequest(f"the object has no tensor dtype (code {meta.dtype})")
        shape = strip_shape_padding(list(meta.shape), fmt)
        # Never busy_loop: this runs on LMCache's event loop, which must keep serving the
        # puts and gets that free memory. No room now is a miss.
        self.obj = self.backend.allocate(shape, dtype, fmt, busy_loop=False)
        if self.obj is None:
            return BufferTooSmall(reply.length, 0, "LMCache's CPU buffer has no room for the object")
        if len(self.obj.byte_array) != reply.length:
            return BufferTooSmall(reply.length, len(self.obj.byte_array), "metadata and length disagree")
        return None

    def take(self, received: Received) -> MemoryObj:
        obj, self.obj = self.obj, None
        assert obj is not None
        return obj

    def release(self) -> None:
        if self.obj is not None:
            self.obj.ref_count_down()
            self.obj = None


def _meta(obj: MemoryObj) -> ObjectMeta:
    shape = pad_shape_to_4d(obj.get_shape())
    fmt = obj.get_memory_format()
    return ObjectMeta(int(fmt.value), DTYPE_TO_INT[obj.get_dtype()], (shape[0], shape[1], shape[2], shape[3]))


def plugin_settings(url: str, name: str = "lmserver", **options: Any) -> dict[str, Any]:
    """The LMCache settings that load this plugin as ``name`` for ``url``, with ``options``
    (see the module docstring) as ``remote_storage_plugin.<name>.<option>``: merge them into
    ``LMCacheEngineConfig.from_defaults(...)`` or the YAML config."""
    prefix = f"remote_storage_plugin.{name}."
    return {
        "remote_storage_plugins": [name],
        "extra_config": {
            prefix + "module_path": __name__,
            prefix + "class_name": LMServerConnector.__name__,
            prefix + "url": url,
            **{prefix + key: value for key, value in options.items()},
        },
    }


def _plugin_name(cls: type, config: Any) -> str | None:
    """Which of LMCache's ``remote_storage_plugins`` names this class (LMCache creates a
    plugin's connector without telling it its name)."""
    extra = getattr(config, "extra_config", None) or {}
    names = [
        name
        for name in getattr(config, "remote_storage_plugins", None) or []
        if extra.get(f"remote_storage_plugin.{name}.class_name") == cls.__name__
    ]
    if len(names) > 1:
        raise ValueError(f"{cls.__name__} is configured under {names}; configure one plugin instance")
    return names[0] if names else None


class LMServerConnector(RemoteConnector):  # type: ignore[misc]
    """LMCache `RemoteConnector` for lmserver; see the module docstring."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        local_cpu_backend: Any,
        config: Any,
        url: str | None = None,
        metadata: Any = None,
    ) -> None:
        metadata = metadata if metadata is not None else getattr(local_cpu_backend, "metadata", None)
        if metadata is not None:  # None in LMCache's scheduler role, which only looks up keys
            super().__init__(config, metadata)
        name = _plugin_name(type(self), config)
        extra = getattr(config, "extra_config", None) or {}

        def option(key: str, default: Any) -> Any:
            return extra.get(f"remote_storage_plugin.{name}.{key}", default) if name else default

        url = url or option("url", None) or os.environ.get("LMSERVER_URL")
        if not url:
            raise ValueError(f"set extra_config remote_storage_plugin.{name or '<name>'}.url or LMSERVER_URL")
        seconds = float(option("timeout", 10.0))
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        self.put_ack = str(option("put_ack", False)).lower() in ("1", "true", "yes")
        self.client = AsyncClient(
            servers=parse_servers(url),
            timeout=Timeout(seconds, connect=min(2.0, seconds)),
            retry=Retry(retries=int(option("retries", 1)), base=0.05, cap=0.5),
            max_connections=int(option("max_connections", 4)),
            exist_many="auto",
            skip_down=True,  # a server that fails is skipped (misses) and retried with backoff
        )
        self._sync_timeout = seconds + SYNC_SLACK
        self._failures = FailureLog(log, "lmserver", LOG_EVERY)
        log.info("lmserver plugin: %s (put_ack=%s)", url, self.put_ack)

    def __repr__(self) -> str:
        return f"<LMServerConnector {','.join(map(str, self.client.settings.servers))}>"

    # -- failures become misses -------------------------------------------------------

    @property
    def errors(self) -> Counter[str]:
        """Failures answered to LMCache as misses, by kind: this connector's calls that
        failed (``get``, ``put``, ``lookup``, ``get (refused)``, ...) and ``unavailable``,
        the operations the client answered as misses (or dropped, for puts) because their
        server was down."""
        counts = self._failures.counts()
        unavailable = self.client.counters["unavailable"]
        if unavailable:
            counts["unavailable"] = unavailable
        return counts

    def _failed(self, what: str, exc: BaseException) -> None:
        self._failures.record(what, exc)

    async def _guard(self, what: str, coro: Coroutine[Any, Any, T], default: T) -> T:
        try:
            return await coro
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed(what, exc)
            return default

    def _blocking(self, what: str, coro: Coroutine[Any, Any, T], default: T) -> T:
        """Run ``coro`` on LMCache's loop from an engine thread and wait for it."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # would wait for itself forever
            coro.close()
            self._failed(what, RuntimeError("called on the connector's own event loop"))
            return default
        future = asyncio.run_coroutine_threadsafe(self._guard(what, coro, default), self.loop)
        try:
            return future.result(self._sync_timeout)
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as exc:
            future.cancel()
            self._failed(what, exc)
            return default

    # -- RemoteConnector ----------------------------------------------------------------

    async def exists(self, key: CacheEngineKey) -> bool:
        return await self._guard("exists", self.client.exists(key.to_string()), False)

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._blocking("exists", self.client.exists(key.to_string()), False)

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await self.batched_get([key]))[0]

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        # LMCache's wrapper releases memory_obj when this returns: a plain PUT returns
        # once the kernel has every byte, a PUT_ACK once the server has stored it.
        await self.batched_put([key], [memory_obj])

    async def list(self) -> Strings:
        return await self._guard("list", self.client.list(), [])

    async def close(self) -> None:
        await self.client.aclose()
        log.info("lmserver plugin closed; failures: %s; client: %s", dict(self.errors), self.client.counters)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when every server answers HEALTH, else 1."""
        return 0 if await self._guard("ping", self.client.health(), False) else 1

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: Keys) -> Found:
        """Pipelined GETs (per connection and server), each received into its own MemoryObj."""
        sinks = [_Allocation(self.local_cpu_backend) for _ in keys]
        ops: builtins.list[Op[Any]] = [
            self.client._commands.get_with(key.to_string(), sink, sink.take)
            for key, sink in zip(keys, sinks, strict=True)
        ]
        try:
            found: Found = await self.client._call(self.client._grouped(ops))
        except asyncio.CancelledError:
            for sink in sinks:
                sink.release()
            raise
        except Exception as exc:
            for sink in sinks:  # objects of replies that did arrive: nobody will get them
                sink.release()
            self._failed("get", exc)
            return [None] * len(keys)
        for sink in sinks:
            if sink.refused is not None:
                self._failed("get (refused)", sink.refused)
        return found

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: Keys, memory_objs: Objects) -> None:
        """Pipelined PUTs, each straight from its MemoryObj's bytes with its metadata."""
        try:
            ops: builtins.list[Op[Any]] = [
                self.client._commands.put(key.to_string(), obj.byte_array, _meta(obj), self.put_ack)
                for key, obj in zip(keys, memory_objs, strict=True)
            ]
            await self.client._call(self.client._grouped(ops))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failed("put", exc)

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: Keys) -> int:
        """How many leading keys are stored: one EXIST_MANY round trip (split per server
        and connection, sent concurrently)."""
        return self._blocking("lookup", self._hit_prefix(keys), 0)

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: Keys, pin: bool = False) -> int:
        return await self._guard("lookup", self._hit_prefix(keys), 0)

    async def _hit_prefix(self, keys: Keys) -> int:
        hits = await self.client.exists_many([key.to_string() for key in keys])
        return hits.index(False) if False in hits else len(hits)

    def remove_sync(self, key: CacheEngineKey) -> bool:
        return self._blocking("remove", self.client.delete(key.to_string()), False)
