"""Reconnects, retries and timeouts: servers that die, restart, hang or lack extensions."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

import pytest

from lmclient import (
    ConnectError,
    ConnectTimeout,
    ReadTimeout,
    Retry,
    ServerError,
    Timeout,
    WriteTimeout,
)
from lmproto import Command, Generation

FAST_RETRY = Retry(retries=2, base=0.01, cap=0.02)


def test_server_killed_and_restarted_on_the_same_port(make_client: Any, spawn_server: Any) -> None:
    server = spawn_server()
    client = make_client(server.host, server.port, retry=FAST_RETRY)
    client.put("k", b"before", ack=True)
    assert client.get("k") == b"before"
    server.kill()
    server.restart()
    # The pooled connection is dead; the next calls replace it without an error.
    client.put("k", b"after")
    assert client.get("k") == b"after"
    assert client.health()


def test_call_while_the_server_is_down_succeeds_once_it_is_back(make_client: Any, spawn_server: Any) -> None:
    server = spawn_server()
    client = make_client(server.host, server.port, retry=Retry(retries=40, base=0.05, cap=0.25))
    client.put("k", b"v", ack=True)
    server.kill()
    restart = threading.Timer(0.3, server.restart)
    restart.start()
    try:
        client.put("k", b"again", ack=True)  # refused, refused, ... then served
    finally:
        restart.join()
    assert client.get("k") == b"again"


def test_connection_cut_mid_exchange_is_retried(
    make_client: Any, server_thread: Any, drop_first_relay: Any
) -> None:
    relay = drop_first_relay(server_thread)
    client = make_client(relay.host, relay.port, retry=FAST_RETRY)
    client.put("k", b"v", ack=True)  # 1st connection dies under it; the 2nd serves it
    assert relay.accepted == 2
    assert client.get("k") == b"v"


def test_connect_refused_after_retries(make_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_client("127.0.0.1", port, retry=FAST_RETRY)
    with caplog.at_level(logging.DEBUG, logger="lmclient"), pytest.raises(ConnectError):
        client.get("k")
    assert sum("retrying" in r.getMessage() for r in caplog.records) == 2
    assert client.health() is False


def test_connect_timeout(make_client: Any, unanswered_port: Any) -> None:
    port = unanswered_port
    client = make_client(port.host, port.port, timeout=Timeout(5, connect=0.2), retry=0)
    started = time.monotonic()
    with pytest.raises(ConnectTimeout):
        client.get("k")
    assert time.monotonic() - started < 3


def test_read_timeout_against_a_server_that_never_answers(make_client: Any, silent_server: Any) -> None:
    client = make_client(silent_server.host, silent_server.port, timeout=Timeout(0.2), retry=3)
    started = time.monotonic()
    with pytest.raises(ReadTimeout):
        client.exists("k")  # not retried: a read timeout is not a network error by default
    assert time.monotonic() - started < 2


def test_read_timeout_retried_when_asked(make_client: Any, silent_server: Any) -> None:
    retry = Retry(retries=2, base=0.01, cap=0.01, on_timeout=True)
    timeout = Timeout(0.1, total=10)  # room for the retries within the call's deadline
    client = make_client(silent_server.host, silent_server.port, timeout=timeout, retry=retry)
    with pytest.raises(ReadTimeout):
        client.get("k")
    assert silent_server.accepted == 3  # each attempt on a fresh connection


def test_write_timeout_against_a_server_that_never_reads(make_client: Any, silent_server: Any) -> None:
    client = make_client(silent_server.host, silent_server.port, timeout=Timeout(0.3), retry=0)
    with pytest.raises(WriteTimeout):
        client.put("k", bytes(256 * 1024**2))  # far more than the socket buffers hold


@pytest.mark.parametrize("generation", [Generation.V0, Generation.V1], ids=["v0", "v1"])
def test_exists_many_falls_back_when_the_server_answers_400(
    make_client: Any, fake_upstream: Any, generation: Generation
) -> None:
    server = fake_upstream(generation, "fail")
    client = make_client(server.host, server.port, protocol=generation)
    client.put("a", b"1")
    client.put("c", b"3")
    assert client.exists_many(["a", "b", "c"]) == [True, False, True]
    assert client.exists_many(["c", "a"]) == [True, True]
    assert server.commands.count(Command.EXIST_MANY) == 1  # probed once, remembered
    assert server.commands.count(Command.EXIST) == 5


def test_exists_many_falls_back_when_the_server_never_answers(make_client: Any, fake_upstream: Any) -> None:
    server = fake_upstream(Generation.V0, "silent")  # upstream v0: unknown commands get nothing
    client = make_client(server.host, server.port, protocol="v0", probe_timeout=0.2)
    client.put("a", b"1")
    started = time.monotonic()
    assert client.exists_many(["a", "b"]) == [True, False]
    assert time.monotonic() - started < 2
    assert client.exists_many(["b", "a"]) == [False, True]
    assert server.commands.count(Command.EXIST_MANY) == 1


def test_exists_many_probe_that_cannot_connect_decides_nothing(make_client: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = make_client("127.0.0.1", port, retry=FAST_RETRY)
    with pytest.raises(ConnectError):
        client.exists_many(["a"])
    assert client._exist_many is None  # still to be probed once a server is there


def test_exists_many_modes(make_client: Any, fake_upstream: Any) -> None:
    server = fake_upstream(Generation.V1, "fail")
    always = make_client(server.host, server.port, exist_many="always")
    with pytest.raises(ServerError) as info:
        always.exists_many(["a"])
    assert info.value.status == 400
    never = make_client(server.host, server.port, exist_many="never")
    assert never.exists_many(["a"]) == [False]
    assert server.commands.count(Command.EXIST_MANY) == 1


def test_upstream_server_basics(make_client: Any, fake_upstream: Any, protocol: str) -> None:
    server = fake_upstream(Generation.V0 if protocol == "v0" else Generation.V1, "fail")
    client = make_client(server.host, server.port, protocol=protocol)
    client.put("k", b"v")
    assert client.get("k") == b"v"
    assert client.list() == ["k"]
    with pytest.raises(ServerError):
        client.delete("k")  # an extension: upstream refuses it


def test_pipelined_waiters_all_fail_together(silent_server: Any) -> None:
    import asyncio

    from lmclient import AsyncClient

    async def main() -> list[BaseException | bool]:
        async with AsyncClient(
            silent_server.host, silent_server.port, timeout=Timeout(0.2), retry=0, max_connections=1
        ) as client:
            return await asyncio.gather(*(client.exists(f"k{i}") for i in range(10)), return_exceptions=True)

    started = time.monotonic()
    results = asyncio.run(main())
    assert all(isinstance(r, ReadTimeout) for r in results), results
    assert time.monotonic() - started < 2
    assert silent_server.accepted == 1


def test_waiters_behind_a_failed_exchange_are_retried(server_thread: Any, drop_first_relay: Any) -> None:
    import asyncio

    from lmclient import AsyncClient

    relay = drop_first_relay(server_thread)

    async def main() -> list[bytes | None]:
        async with AsyncClient(relay.host, relay.port, retry=FAST_RETRY, max_connections=1) as client:
            await client.put("k", b"v", ack=True)
            return await asyncio.gather(*(client.get("k") for _ in range(20)))

    assert asyncio.run(main()) == [b"v"] * 20


def test_pool_timeout_when_every_connection_is_busy(silent_server: Any) -> None:
    from lmclient import Client, PoolTimeout

    timeout = Timeout(0.5, pool=0.1)
    with Client(
        silent_server.host, silent_server.port, timeout=timeout, retry=0, max_connections=1
    ) as client:

        def hold_the_only_connection() -> None:
            with pytest.raises(ReadTimeout):
                client.exists("k")

        holder = threading.Thread(target=hold_the_only_connection)
        holder.start()
        deadline = time.monotonic() + 5
        while silent_server.accepted == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PoolTimeout):
            client.exists("other")
        holder.join()


def test_health_is_false_when_the_server_does_not_answer(make_client: Any, fake_upstream: Any) -> None:
    server = fake_upstream(Generation.V0, "silent")  # upstream v0 has no HEALTH
    client = make_client(server.host, server.port, protocol="v0", probe_timeout=0.2)
    started = time.monotonic()
    assert client.health() is False
    assert time.monotonic() - started < 2
