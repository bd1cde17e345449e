"""Many coroutines on one AsyncClient, many threads on one Client: everyone gets their own
answer, in every frame generation, with pipelining on a few connections; and everyone
reads their own writes (a plain PUT, then a GET of the key, never misses)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from lmclient import AsyncClient, BufferTooSmall, Client

from .conftest import _Listener


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
        assert len(client._open_lanes(0)) <= max_connections
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


async def test_keys_spread_over_the_pool_and_each_key_keeps_its_connection(server_thread: Any) -> None:
    blob = bytes(1024**2)
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=4) as client:
        keys = [f"a{i}" for i in range(32)]
        await asyncio.gather(*(client.put(k, blob, ack=True) for k in keys))
        assert client._open_lanes(0) == [0, 1, 2, 3]  # parallel transfers on every connection
        lanes = {k: client._placement.lane(k) for k in keys}
        for key in keys:  # the connection a key's commands use depends on the key alone
            conn = client._lanes[0][lanes[key]]
            assert conn is not None
            before = conn._writes
            await client.put(key, b"1")
            assert await asyncio.gather(client.get(key), client.exists(key)) == [b"1", True]
            assert conn._writes == before + 3


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


# ---------------------------------------------------------------------------------------
# read-your-writes: deterministic, whatever the timing of the connections


class SlowOddConnections(_Listener):
    """Relays every connection to a real server, holding each request chunk of odd-numbered
    connections back by ``delay`` seconds: a PUT sent on a slow connection reaches the
    server long after a GET sent later on a fast one, unless both share a connection."""

    def __init__(self, target: tuple[str, int], delay: float) -> None:
        self.target = target
        self.delay = delay
        super().__init__()

    def on_connection(self, conn: socket.socket, number: int) -> None:
        upstream = socket.create_connection(self.target)
        self.conns.append(upstream)
        self.spawn(self._pump, conn, upstream, self.delay if number % 2 else 0.0)
        self.spawn(self._pump, upstream, conn, 0.0)

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(1 << 20):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.fixture
def slow_relay(server_thread: Any) -> Iterator[SlowOddConnections]:
    relay = SlowOddConnections((server_thread.host, server_thread.port), delay=0.02)
    yield relay
    relay.close()


def test_threads_read_their_writes_behind_a_slow_connection(slow_relay: Any, protocol: str) -> None:
    # Whatever the timing, a key's PUT and GET share one connection, so the GET cannot
    # overtake the PUT. (The coroutine twin below failed with the former design, which
    # followed "the" connection holding an unconfirmed PUT: two could hold one.)
    with Client(slow_relay.host, slow_relay.port, protocol=protocol, max_connections=4) as client:

        def worker(n: int) -> int:
            misses = 0
            for i in range(15):
                key = f"s{n}-{i}"
                client.put(key, key.encode())
                misses += client.get(key) != key.encode()
                misses += client.exists_many([key, key + "-no"]) != [True, False]
            return misses

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(worker, range(8))) == 0
        assert slow_relay.accepted >= 2  # slow and fast connections were both in use
        assert len(client.list("s")) == 120


async def test_coroutines_read_their_writes_behind_a_slow_connection(slow_relay: Any) -> None:
    async with AsyncClient(slow_relay.host, slow_relay.port, max_connections=4) as client:

        async def one(i: int) -> int:
            key = f"c{i}"
            await client.put(key, key.encode())
            got = await client.get(key)
            await client.put(key, b"second")
            return (got != key.encode()) + (await client.get(key) != b"second")

        assert sum(await asyncio.gather(*(one(i) for i in range(200)))) == 0
        assert slow_relay.accepted >= 2


STRESS_PAIRS = 8_000


def test_stress_threads_put_then_get(server_thread: Any) -> None:
    with Client(server_thread.host, server_thread.port, max_connections=4) as client:

        def worker(n: int) -> int:
            misses = 0
            for i in range(STRESS_PAIRS // 8):
                key = f"t{n}-{i % 50}"  # keys are overwritten: a stale value counts too
                value = f"{n}-{i}".encode()
                client.put(key, value)
                misses += client.get(key) != value
            return misses

        with ThreadPoolExecutor(8) as pool:
            assert sum(pool.map(worker, range(8))) == 0


async def test_stress_coroutines_put_then_get(server_thread: Any) -> None:
    async with AsyncClient(server_thread.host, server_thread.port, max_connections=4) as client:

        async def worker(n: int) -> int:
            misses = 0
            for i in range(STRESS_PAIRS * 4 // 64):
                key = f"a{n}-{i % 20}"
                value = f"{n}-{i}".encode()
                await client.put(key, value)
                misses += await client.get(key) != value
            return misses

        assert sum(await asyncio.gather(*(worker(n) for n in range(64)))) == 0
