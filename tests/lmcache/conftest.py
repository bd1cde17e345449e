"""LMCache's own storage stack (RemoteBackend over a real LocalCPUBackend, CPU only) wired to
real lmservers, either through the plugin (lmclient.lmcache, loaded by LMCache's plugin
framework) or through LMCache's built-in ``lm://`` connector.

LMCache is installed without its dependencies (see .ci/run); CI always has it. A checkout
without it skips these tests, except under CI, where a missing LMCache is a failure.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # no usage reporting from tests
if not os.environ.get("CI"):
    pytest.importorskip("lmcache", reason="LMCache is not installed (see .ci/run)")

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.remote_backend import RemoteBackend

from lmclient.lmcache import plugin_settings

CHUNK = 16  # tokens per chunk
KV_SHAPE = (2, 2, CHUNK, 4, 32)  # layers, K/V, tokens, heads, head size: 16 KiB chunks in bf16
DTYPE = torch.bfloat16


def chunk_key(i: int, model: str = "test/model") -> CacheEngineKey:
    return CacheEngineKey(model_name=model, world_size=1, worker_id=0, chunk_hash=0x1000 + i, dtype=DTYPE)


class Engine:
    """What an inference engine's LMCache does with one RemoteBackend: store, look up,
    retrieve. ``via``: "plugin" (lmclient.lmcache) or "builtin" (LMCache's lm:// connector)."""

    def __init__(self, urls: Sequence[str], via: str, cpu_gib: float = 0.25, **extra: Any) -> None:
        url = "lm://" + ",".join(u.removeprefix("lm://") for u in urls)
        settings: dict[str, Any] = {
            "chunk_size": CHUNK,
            "local_cpu": False,  # every hit must come from the server
            "max_local_cpu_size": cpu_gib,
            "remote_serde": "naive",
            "lmcache_instance_id": f"test-{via}",
            "blocking_timeout_secs": 20,
        }
        if via == "plugin":
            settings.update(plugin_settings(url, **extra))
        else:
            settings["remote_url"] = url
        self.config = LMCacheEngineConfig.from_defaults(**settings)
        self.metadata = LMCacheMetadata(
            model_name="test/model",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=KV_SHAPE,
            chunk_size=CHUNK,
        )
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.cpu = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.backend = RemoteBackend(
            self.config,
            self.metadata,
            self.loop,
            self.cpu,
            dst_device="cpu",
            plugin_name="lmserver" if via == "plugin" else None,
        )
        assert self.backend.connection is not None, "LMCache could not create the connector"

    @property
    def connector(self) -> Any:
        return self.backend.connection.getWrappedConnector()  # type: ignore[union-attr]

    def chunk(self, i: int, tokens: int = CHUNK) -> MemoryObj:
        """A MemoryObj from LMCache's allocator holding chunk ``i``'s (deterministic) KV."""
        shape = torch.Size([2, KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]])
        obj = self.cpu.allocate(shape, DTYPE, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.copy_(expected(i, shape))
        return obj

    def store(self, keys: Sequence[CacheEngineKey], objs: Sequence[MemoryObj], batched: bool = True) -> None:
        """Hand chunks to the backend as the engine does, and wait until the puts are done."""
        if batched:
            self.backend.batched_submit_put_task(list(keys), list(objs))
        else:
            for key, obj in zip(keys, objs, strict=True):
                self.backend.submit_put_task(key, obj)
        self.run(_drain())  # LMCache does not hand out batched puts' futures
        for obj in objs:
            obj.ref_count_down()  # the engine's own reference

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def lookup(self, keys: Sequence[CacheEngineKey]) -> int:
        return int(self.backend.batched_contains(list(keys)))

    def retrieve(self, keys: Sequence[CacheEngineKey]) -> list[MemoryObj | None]:
        return list(self.backend.batched_get_blocking(list(keys)))

    def close(self) -> None:
        self.backend.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
        self.cpu.close()


async def _drain() -> None:
    """Wait for every other task on this loop (the puts LMCache submitted) to finish."""
    me = asyncio.current_task()
    while others := [task for task in asyncio.all_tasks() if task is not me]:
        await asyncio.wait(others)


def expected(i: int, shape: torch.Size) -> torch.Tensor:
    generator = torch.Generator().manual_seed(i)
    return torch.randn(shape, generator=generator).to(DTYPE)


def wait_for(predicate: Callable[[], bool], what: str, deadline: float = 60.0) -> None:
    """Poll until ``predicate()`` (a generous deadline, only to detect a hang)."""
    end = time.monotonic() + deadline
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def check_retrieved(objs: Sequence[MemoryObj | None], indexes: Sequence[int], tokens: int = CHUNK) -> None:
    """Each retrieved chunk has the stored bytes, shape and dtype; releases them."""
    for obj, i in zip(objs, indexes, strict=True):
        assert obj is not None, f"chunk {i} missed"
        shape = torch.Size([2, KV_SHAPE[0], tokens, KV_SHAPE[3] * KV_SHAPE[4]])
        assert obj.tensor.dtype == DTYPE and obj.tensor.shape == shape, (obj.tensor.dtype, obj.tensor.shape)
        assert obj.get_memory_format() == MemoryFormat.KV_2LTD
        assert torch.equal(obj.tensor, expected(i, shape)), f"chunk {i} differs"
        obj.ref_count_down()


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(urls: Sequence[str], via: str, **extra: Any) -> Engine:
        made.append(Engine(urls, via, **extra))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
