"""lmclient.lmcache_mp: the L2 adapter of LMCache's multi-process mode against real lmservers.

Built by LMCache 0.5.6's own parser and factory from the ``--l2-adapter`` JSON (the plugin
route), then driven either by LMCache's real StorageManager (L1 in host memory, its store,
prefetch and L2 eviction controllers, on CPU) or directly in the controllers' call pattern
(submit, poll the eventfd, query) where a test needs to act between two calls.
"""

from __future__ import annotations

import argparse
import json
import re
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lmcache.v1.distributed.api import (
    GroupedObjectKeys,
    MemoryLayoutDesc,
    ObjectKey,
    PrefetchTaskSpec,
)
from lmcache.v1.distributed.config import parse_args
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.distributed.storage_manager import StorageManager
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform import consume_fd

from lmclient import Client
from lmclient._l2keys import HASHED_PREFIX, KeyFields, object_name
from lmclient.lmcache_mp import LMServerL2Adapter, adapter_spec

from .conftest import wait_for

SHAPE = torch.Size([2, 4, 16, 64])  # [K/V, layers, tokens, hidden]: 16 KiB in bfloat16
LAYOUT = MemoryLayoutDesc(shapes=[SHAPE], dtypes=[torch.bfloat16])
CHUNK_BYTES = SHAPE.numel() * 2
MODEL = "test/model"


def key(i: int, model: str = MODEL, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(32, "big"), model_name=model, kv_rank=0, cache_salt=salt)


def url_of(*servers: Any) -> str:
    return "lm://" + ",".join(f"{s.host}:{s.port}" for s in servers)


def chunk(i: int) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)


# ---------------------------------------------------------------------------------------
# the StorageManager route


class Manager:
    """LMCache's StorageManager with this adapter as its only L2, as `lmcache server` builds it."""

    def __init__(self, spec: dict[str, Any]) -> None:
        argv = ["--l1-size-gb", "0.03", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)]
        self.sm = StorageManager(parse_args(argv))
        self.adapter: LMServerL2Adapter = next(a for _, a in self.sm.l2_adapters())

    def store(self, indexes: list[int]) -> None:
        """Write chunks into L1 and wait until the store controller has handed them to L2."""
        keys = [key(i) for i in indexes]
        before = self.adapter.report_status()["counts"].get("stored_keys", 0)
        before += self.adapter.report_status()["counts"].get("store_failures", 0)
        objs = self.sm.reserve_write(keys, LAYOUT)
        assert len(objs) == len(keys)
        for i, k in zip(indexes, keys, strict=True):
            objs[k].tensor.copy_(chunk(i))
        self.sm.finish_write(keys)

        def handed() -> bool:
            counts = self.adapter.report_status()["counts"]
            return counts.get("stored_keys", 0) + counts.get("store_failures", 0) >= before + len(keys)

        wait_for(handed, "the store controller's L2 store")

    def drop_l1(self, indexes: list[int]) -> None:
        assert self.sm.delete_l1_keys([key(i) for i in indexes], force=True)[0] == len(indexes)

    def prefetch(self, indexes: list[int], timeout: float = 30.0) -> tuple[list[int], float]:
        """Prefetch into L1 (all found keys, not only a prefix); the indexes that came back
        with the right bytes, and the seconds it took. Releases what it read."""
        keys = [key(i) for i in indexes]
        spec = PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=LAYOUT)],
            fetching_policy="full",
        )
        started = time.monotonic()
        handle = self.sm.submit_prefetch_task(spec)
        assert self.sm.wait_prefetch_status(handle, timeout), "prefetch never completed"
        elapsed = time.monotonic() - started
        result = self.sm.query_prefetch_status(handle)
        assert result is not None
        hits = result.hit_cells[0].get_indices_list()
        got = [keys[h] for h in hits]
        good = []
        for k, obj in zip(got, self.sm.unsafe_read(got, result.l1_owners)[1], strict=True):
            i = indexes[keys.index(k)]
            if torch.equal(obj.tensor, chunk(i)):
                good.append(i)
        self.sm.finish_read_prefetched(got, l1_owners=result.l1_owners)
        return good, elapsed

    def healthy(self) -> bool:
        return bool(self.sm.report_status()["is_healthy"])

    def close(self) -> None:
        self.sm.close()


@pytest.fixture
def managers() -> Iterator[Callable[[dict[str, Any]], Manager]]:
    made: list[Manager] = []

    def make(spec: dict[str, Any]) -> Manager:
        made.append(Manager(spec))
        return made[-1]

    yield make
    for manager in made:
        manager.close()


def test_storage_manager_stores_prefetches_lists_and_accounts(managers: Any, server_thread: Any) -> None:
    m = managers(adapter_spec(url_of(server_thread)))
    m.store(list(range(8)))
    m.drop_l1(list(range(8)))
    loaded, _ = m.prefetch([*range(8), 100, 101])  # two keys nobody stored
    assert loaded == list(range(8))
    assert m.healthy()

    adapter = m.adapter
    assert adapter.get_usage().total_bytes_used == 8 * CHUNK_BYTES
    listed, cursor = [], None
    while True:
        page = adapter.list_l2_keys(MODEL, page_size=3, cursor=cursor)
        listed += page.entries
        if page.next_page_token is None:
            break
        cursor = page.next_page_token
    assert [e.key.to_object_key() for e in listed] == sorted((key(i) for i in range(8)), key=object_name_of)
    assert {e.size_bytes for e in listed} == {CHUNK_BYTES}
    assert adapter.list_l2_keys("another/model").entries == ()
    status = adapter.report_status()
    assert status["counts"]["stored_keys"] == 8 and status["counts"]["loaded_keys"] == 8
    assert status["pending_tasks"] == 0 and status["locked_keys"] == 0


def object_name_of(k: ObjectKey) -> str:
    return object_name(KeyFields(k.chunk_hash, k.model_name, k.kv_rank, k.object_group_id, k.cache_salt))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({}, "'url' is required"),
        ({"url": "http://x:1"}, "bad 'url'"),
        ({"url": "lm://127.0.0.1:1", "timeout": 0}, "'timeout' must be > 0"),
        ({"url": "lm://127.0.0.1:1", "max_connections": "8"}, "'max_connections' must be a int"),
        ({"url": "lm://127.0.0.1:1", "retry": 2}, "unknown lmserver L2 adapter parameter(s) ['retry']"),
    ],
)
def test_bad_parameters_fail_at_startup_with_a_clear_message(params: dict[str, Any], message: str) -> None:
    spec = {**adapter_spec("lm://127.0.0.1:1"), "adapter_params": params}
    with pytest.raises(ValueError, match=re.escape(message)):
        StorageManager(
            parse_args(["--l1-size-gb", "0.01", "--eviction-policy", "LRU", "--l2-adapter", json.dumps(spec)])
        )


def test_kill_and_restart_fails_fast_reports_unhealthy_and_recovers(
    managers: Any, spawn_server: Any, tmp_path: Path
) -> None:
    server = spawn_server("--disk", str(tmp_path / "disk"))
    m = managers(adapter_spec(url_of(server), task_timeout=20.0))
    m.store([0, 1, 2])
    m.drop_l1([0, 1, 2])
    server.kill()

    loaded, elapsed = m.prefetch([0, 1, 2])  # a down server is a miss, at once
    assert loaded == [] and elapsed < 10
    m.store([3])  # fails: counted, and the L1 copy stays
    assert m.adapter.report_status()["counts"]["store_failures"] >= 1
    wait_for(lambda: not m.healthy(), "report_status to say unhealthy")

    server.restart()
    wait_for(m.healthy, "the restarted server to be used again")
    loaded, _ = m.prefetch([0, 1, 2])  # the disk tier kept what was stored before the kill
    assert loaded == [0, 1, 2]
    m.store([4])
    m.drop_l1([4])
    assert m.prefetch([4])[0] == [4]


def test_several_servers_with_one_down(managers: Any, make_server_thread: Any, spawn_server: Any) -> None:
    servers = [make_server_thread(), make_server_thread(), spawn_server()]
    m = managers(adapter_spec(url_of(*servers)))
    indexes = list(range(24))
    m.store(indexes)
    m.drop_l1(indexes)
    placement = Client(servers=[(s.host, s.port) for s in servers])
    doomed = f"{servers[2].host}:{servers[2].port}"
    lost = {i for i in indexes if placement.server_for(object_name_of(key(i))) == doomed}
    assert 0 < len(lost) < len(indexes)
    servers[2].kill()

    loaded, elapsed = m.prefetch(indexes)
    assert loaded == [i for i in indexes if i not in lost] and elapsed < 10
    wait_for(lambda: not m.healthy(), "report_status to say unhealthy")
    status = m.adapter.report_status()
    assert status["servers_up"][doomed] is False
    assert [up for address, up in status["servers_up"].items() if address != doomed] == [True, True]


def test_lmcache_eviction_deletes_from_the_server(managers: Any, server_thread: Any) -> None:
    spec = adapter_spec(url_of(server_thread), capacity_bytes=8 * CHUNK_BYTES)
    spec["eviction"] = {"eviction_policy": "LRU", "trigger_watermark": 0.5, "eviction_ratio": 0.5}
    m = managers(spec)
    m.store(list(range(6)))  # 6/8 of the capacity: above the watermark
    adapter = m.adapter
    wait_for(lambda: adapter.get_usage().total_bytes_used <= 4 * CHUNK_BYTES, "LMCache's L2 eviction")
    with Client(server_thread.host, server_thread.port) as client:
        held = client.exists_many([object_name_of(key(i)) for i in range(6)])
    assert sum(held) * CHUNK_BYTES == adapter.get_usage().total_bytes_used
    assert adapter.report_status()["counts"]["deleted_keys"] == 6 - sum(held)


# ---------------------------------------------------------------------------------------
# the controllers' call pattern, driven directly


def make_adapter(url: str, **params: Any) -> LMServerL2Adapter:
    """Built as the StorageManager builds it: LMCache's parser, then its factory."""
    namespace = argparse.Namespace(l2_adapter=[json.dumps(adapter_spec(url, **params))])
    config = parse_args_to_l2_adapters_config(namespace).adapters[0]
    adapter = create_l2_adapter(config, None)
    adapter.set_backend_identity("plugin", shared=config.shared)
    assert isinstance(adapter, LMServerL2Adapter)
    return adapter


@pytest.fixture
def adapters() -> Iterator[Callable[..., LMServerL2Adapter]]:
    made: list[LMServerL2Adapter] = []

    def make(url: str, **params: Any) -> LMServerL2Adapter:
        made.append(make_adapter(url, **params))
        return made[-1]

    yield make
    for adapter in made:
        adapter.close()


def buffers(count: int, size: int = CHUNK_BYTES, fill: int | None = None) -> list[TensorMemoryObj]:
    """L1-like objects: views of one 4096-aligned buffer, as LMCache's allocator hands out."""
    backing = torch.zeros(count * size + 4096, dtype=torch.uint8)
    offset = (-backing.data_ptr()) % 4096
    objs = []
    for i in range(count):
        raw = backing[offset + i * size : offset + (i + 1) * size]
        whole = size == CHUNK_BYTES  # a chunk's layout, else plain bytes
        if fill is not None:
            raw.fill_(fill)
        elif whole:
            raw.view(torch.bfloat16).copy_(chunk(i).flatten())
        meta = MemoryObjMetadata(
            shape=SHAPE if whole else torch.Size([size]),
            dtype=torch.bfloat16 if whole else torch.uint8,
            address=i * size,
            phy_size=size,
            fmt=MemoryFormat.KV_2LTD,
            ref_count=1,
        )
        objs.append(TensorMemoryObj(raw_data=raw, metadata=meta, parent_allocator=None))
    return objs


def wait_fd(fd: int, timeout: float = 30.0) -> None:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    assert poller.poll(timeout * 1000), "the task never signalled its eventfd"
    consume_fd(fd)


def store(adapter: LMServerL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> Any:
    task = adapter.submit_store_task(keys, objs)
    while True:
        wait_fd(adapter.get_store_event_fd())
        done = adapter.pop_completed_store_tasks()
        if task in done:
            return done[task]


def lookup(adapter: LMServerL2Adapter, keys: list[ObjectKey]) -> list[int]:
    task = adapter.submit_lookup_and_lock_task(keys, {0: LAYOUT})
    while (bitmap := adapter.query_lookup_and_lock_result(task)) is None:
        wait_fd(adapter.get_lookup_and_lock_event_fd())
    assert adapter.query_lookup_and_lock_result(task) is None  # a result is returned once
    return list(bitmap.get_indices_list())


def load(adapter: LMServerL2Adapter, keys: list[ObjectKey], objs: list[Any]) -> list[int]:
    task = adapter.submit_load_task(keys, objs)
    while (bitmap := adapter.query_load_result(task)) is None:
        wait_fd(adapter.get_load_event_fd())
    return list(bitmap.get_indices_list())


def test_a_key_that_vanishes_between_lookup_and_load_is_a_miss(adapters: Any, server_thread: Any) -> None:
    adapter = adapters(url_of(server_thread))
    keys = [key(i) for i in range(4)]
    assert store(adapter, keys, buffers(4)).is_successful()
    assert lookup(adapter, keys) == [0, 1, 2, 3]
    with Client(server_thread.host, server_thread.port) as other:  # another instance, or lmserver's LRU
        assert other.delete(object_name_of(keys[1]))
    targets = buffers(4, fill=0)
    assert load(adapter, keys, targets) == [0, 2, 3]
    assert torch.equal(targets[0].tensor, chunk(0)) and not targets[1].raw_data.any()
    adapter.submit_unlock(keys)
    assert adapter.report_status()["locked_keys"] == 0


def test_an_object_of_another_size_or_layout_is_a_miss_and_leaves_the_buffer(
    adapters: Any, server_thread: Any
) -> None:
    adapter = adapters(url_of(server_thread))
    assert store(adapter, [key(0), key(1)], buffers(2)).is_successful()
    smaller = buffers(1, size=CHUNK_BYTES // 2, fill=7)
    assert load(adapter, [key(0)], smaller) == []
    assert bool((smaller[0].raw_data == 7).all())
    other_layout = buffers(1, size=CHUNK_BYTES, fill=7)
    other_layout[0].meta.dtype, other_layout[0].meta.shape = torch.uint8, torch.Size([CHUNK_BYTES])
    assert load(adapter, [key(1)], other_layout) == []
    assert adapter.report_status()["counts"]["load_refused_layout"] == 2
    assert load(adapter, [key(1)], buffers(1, fill=0)) == [0]  # the connection went on


def test_every_task_completes_within_its_timeout_against_a_server_that_never_answers(
    adapters: Any,
) -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody reads
        host, port = silent.getsockname()[:2]
        adapter = adapters(f"lm://{host}:{port}", task_timeout=0.5, timeout=30.0)
        keys = [key(i) for i in range(3)]
        started = time.monotonic()
        assert not store(adapter, keys, buffers(3)).is_successful()
        assert lookup(adapter, keys) == []
        assert load(adapter, keys, buffers(3, fill=0)) == []
        adapter.delete(keys)  # bounded too, and never raises
        assert time.monotonic() - started < 20
        status = adapter.report_status()
        assert status["pending_tasks"] == 0 and status["failures"]["task (timed out)"] >= 3


def test_long_model_names_and_salts_use_the_hashed_form(adapters: Any, server_thread: Any) -> None:
    adapter = adapters(url_of(server_thread))
    long_key = key(1, model="org/" + "m" * 90, salt="s" * 100)
    name = object_name_of(long_key)
    assert name.startswith(HASHED_PREFIX) and len(name.encode()) == 79
    assert store(adapter, [long_key, key(2)], buffers(2)).is_successful()
    assert lookup(adapter, [long_key]) == [0]
    targets = buffers(1, fill=0)
    assert load(adapter, [long_key], targets) == [0]
    assert torch.equal(targets[0].tensor, chunk(0))
    listed = adapter.list_l2_keys(page_size=10).entries  # the hashed key cannot be listed
    assert [e.key.to_object_key() for e in listed] == [key(2)]


def test_a_delete_of_a_locked_key_waits_for_its_unlock(adapters: Any, server_thread: Any) -> None:
    adapter = adapters(url_of(server_thread))
    keys = [key(0), key(1)]
    assert store(adapter, keys, buffers(2)).is_successful()
    assert lookup(adapter, [keys[0]]) == [0]
    adapter.delete(keys)
    with Client(server_thread.host, server_thread.port) as other:
        names = [object_name_of(k) for k in keys]
        assert other.exists_many(names) == [True, False]
        assert adapter.get_usage().total_bytes_used == CHUNK_BYTES
        adapter.submit_unlock([keys[0]])
        wait_for(lambda: not other.exists(names[0]), "the delete deferred to the unlock")
    wait_for(lambda: adapter.get_usage().total_bytes_used == 0, "the deferred delete's accounting")


def test_eventfds_are_distinct_and_close_is_bounded_and_final(server_thread: Any) -> None:
    first, second = make_adapter(url_of(server_thread)), make_adapter(url_of(server_thread))
    fds = [
        fd
        for a in (first, second)
        for fd in (a.get_store_event_fd(), a.get_lookup_and_lock_event_fd(), a.get_load_event_fd())
    ]
    assert len(set(fds)) == 6
    started = time.monotonic()
    first.close()
    first.close()
    second.close()
    assert time.monotonic() - started < 15
    assert first.report_status()["is_healthy"] is False
    first.submit_lookup_and_lock_task([key(0)], {})  # after close: completes, signals nothing
