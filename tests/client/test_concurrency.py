"""Many coroutines on one AsyncClient, many threads on one Client: everyone gets their own
answer, in every frame generation, with pipelining on a few connections."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from lmclient import AsyncClient, BufferTooSmall, Client


@pytest.mark.parametrize("max_connections", [1, 4])
async def test_100_coroutines_get_their_own_answers(
    server_thread: Any, protocol: str, max_connections: int
) -> None:
    await hundred_coroutines(server_thread, protocol, max_connections)


def test_100_coroutines_on_uvloop(server_thread: Any) -> None:
    uvloop = pytest.importorskip("uvloop")
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(hundred_coroutines(server_thread, "v1", 4))


async def hundred_coroutines(server_thread: Any, protocol: str, max_connections: int) -> None:
    async with AsyncClient(
        server_thread.host, server_thread.port, protocol=protocol, max_connections=max_connections
    ) as client:

        async def one(i: int) -> None:
            value = f"value-{i}-".encode() * (i + 1)
            await client.put(f"key-{i}", value)  # fire-and-forget, then read it back in order
            assert await client.get(f"key-{i}") == value
            assert await client.exists(f"key-{i}")
            assert not await client.exists(f"other-{i}")
            buf = bytearray(len(value))
            assert await client.get_into(f"key-{i}", buf) == len(value)
            assert buf == value

        await asyncio.gather(*(one(i) for i in range(100)))
        assert len(client._conns) <= max_connections
        assert sorted(await client.list("key-")) == sorted(f"key-{i}" for i in range(100))


async def test_large_and_small_transfers_interleave(server_thread: Any) -> None:
    big = np.random.default_rng(0).integers(0, 255, 4 * 1024**2, dtype=np.uint8)
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=2) as client:
        await client.put("big", big, ack=True)

        async def fetch_big() -> bool:
            out = np.empty_like(big)
            return await client.get_into("big", out) == big.size and bool((out == big).all())

        async def small(i: int) -> bool:
            await client.put(f"s{i}", b"x" * i, ack=True)
            return await client.get(f"s{i}") == b"x" * i

        results = await asyncio.gather(*(fetch_big() for _ in range(8)), *(small(i) for i in range(50)))
        assert all(results)


async def test_acknowledged_puts_spread_over_the_pool_plain_puts_stay_ordered(server_thread: Any) -> None:
    blob = bytes(1024**2)
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=4) as client:
        await asyncio.gather(*(client.put(f"a{i}", blob, ack=True) for i in range(8)))
        assert len(client._conns) == 4  # parallel transfers
        await client.put("plain", b"1")  # no reply: the next requests follow it on its connection
        assert [c.unconfirmed_put for c in client._conns].count(True) == 1
        assert await asyncio.gather(client.get("plain"), client.exists("plain")) == [b"1", True]
        assert not any(c.unconfirmed_put for c in client._conns)


async def test_refused_buffer_does_not_disturb_pipelined_neighbours(server_thread: Any) -> None:
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=1) as client:
        await client.put("big", bytes(200_000), ack=True)
        await client.put("small", b"ok", ack=True)

        async def too_small() -> str:
            try:
                await client.get_into("big", bytearray(10))
            except BufferTooSmall:
                return "refused"
            return "fit?"

        results = await asyncio.gather(*(too_small() if i % 2 else client.get("small") for i in range(40)))
        assert results == ["refused" if i % 2 else b"ok" for i in range(40)]


async def test_cancelled_request_leaves_the_connection_usable(server_thread: Any) -> None:
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=1) as client:
        await client.put("k", bytes(1_000_000), ack=True)
        for _ in range(20):
            task = asyncio.ensure_future(client.get("k"))
            await asyncio.sleep(0)  # let it send, then abandon it
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await client.get("k") == bytes(1_000_000)
        await client.put("small", b"s")
        assert await client.get("small") == b"s"


def test_threads_share_one_client(server_thread: Any, protocol: str) -> None:
    with Client(server_thread.host, server_thread.port, protocol=protocol, max_connections=3) as client:

        def worker(n: int) -> None:
            for i in range(50):
                key = f"t{n}-{i}"
                client.put(key, key.encode() * 10)
                assert client.get(key) == key.encode() * 10
                assert client.exists_many([key, key + "-no"]) == [True, False]

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))  # re-raises a worker's failure
        assert len(client.list("t")) == 400
