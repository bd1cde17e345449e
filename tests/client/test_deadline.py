"""One deadline per client call (`Timeout` ``total``): connecting, retries, their backoff and
every wait end within it, so a host that is down costs a call at most that, and with several
servers at most that once per skip period. Both clients (``make_client``). The time bounds
are generous: each only tells a bounded call from one that waits out its unbounded parts."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import pytest

from lmclient import ConnectError, ConnectTimeout, ReadTimeout, Retry, Timeout, WriteTimeout

SLACK = 2.5  # seconds a busy, shared CI machine may add to a bound


def refused_port() -> int:
    with socket.socket() as probe:  # a port nothing listens on: connections are refused
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_retries_and_backoff_end_at_the_deadline(make_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    many = Retry(retries=1000, base=0.01, cap=0.05)  # ~50 s of retries without the deadline
    client = make_client("127.0.0.1", refused_port(), timeout=Timeout(5, total=0.5), retry=many)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="lmclient"), pytest.raises(ConnectError):
        client.get("k")
    elapsed = time.monotonic() - started
    # It retried until one more backoff (at most cap) would have ended past the deadline.
    assert 0.5 - 0.05 <= elapsed < 0.5 + SLACK
    assert sum("retrying" in r.getMessage() for r in caplog.records) >= 3


def test_a_connect_timeout_is_not_retried(
    make_client: Any, unanswered_port: Any, caplog: pytest.LogCaptureFixture
) -> None:
    # The kernel retransmitted the SYN during the wait: another attempt would only double
    # what a host that is down costs the call.
    port = unanswered_port
    client = make_client(port.host, port.port, timeout=Timeout(10, connect=0.3), retry=3)
    started = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="lmclient"), pytest.raises(ConnectTimeout):
        client.get("k")
    assert time.monotonic() - started < 0.3 + SLACK
    assert not any("retrying" in r.getMessage() for r in caplog.records)


def test_each_wait_is_cut_to_the_deadline(make_client: Any, unanswered_port: Any, silent_server: Any) -> None:
    cut = Timeout(30, total=0.3)  # connect, read and write alone would each wait 30 s
    port = unanswered_port
    for call, peer, expected in (
        (lambda c: c.get("k"), port, ConnectTimeout),
        (lambda c: c.exists("k"), silent_server, ReadTimeout),
        (lambda c: c.put("k", bytes(256 * 1024**2)), silent_server, WriteTimeout),  # > socket buffers
    ):
        client = make_client(peer.host, peer.port, timeout=cut, retry=3)
        started = time.monotonic()
        with pytest.raises(expected):
            call(client)
        assert time.monotonic() - started < 0.3 + SLACK, expected


def test_health_ends_within_probe_timeout_even_while_connecting(
    make_client: Any, unanswered_port: Any
) -> None:
    port = unanswered_port
    client = make_client(port.host, port.port, timeout=Timeout(30), probe_timeout=0.3)
    started = time.monotonic()
    assert client.health() is False
    assert time.monotonic() - started < 0.3 + SLACK


def test_a_dead_server_costs_one_deadline_per_skip_period(
    make_client: Any, server_thread: Any, unanswered_port: Any
) -> None:
    port = unanswered_port
    servers = [(server_thread.host, server_thread.port), (port.host, port.port)]
    client = make_client("", 0, servers=servers, timeout=Timeout(30, total=0.3))
    keys = [f"k{i}" for i in range(200)]
    dead = [k for k in keys if client.server_for(k) == f"{port.host}:{port.port}"][:20]
    live = next(k for k in keys if k not in dead)
    started = time.monotonic()
    assert client.get(dead[0]) is None  # pays the deadline: the host never answers
    assert time.monotonic() - started < 0.3 + SLACK
    started = time.monotonic()
    assert [client.get(k) for k in dead[1:]] == [None] * 19  # skipped: misses without waiting
    client.put(live, b"v")
    assert client.get(live) == b"v"  # the live server is unaffected
    assert time.monotonic() - started < SLACK
    assert client.counters["server_down"] == 1 and client.counters["unavailable"] == 20


def test_a_server_the_deadline_left_no_time_for_is_not_marked_down(
    silent_server: Any, server_thread: Any
) -> None:
    from lmclient import Client

    servers = [(silent_server.host, silent_server.port), (server_thread.host, server_thread.port)]
    with Client(servers=servers, timeout=Timeout(30, total=0.3), retry=0) as client:
        keys = [f"k{i}" for i in range(100)]
        silent = [k for k in keys if client.server_for(k) == f"{silent_server.host}:{silent_server.port}"]
        live = [k for k in keys if k not in silent]
        client.put_many(live, [b"v"] * len(live))
        # One server after the other: the silent one uses up the call's deadline, so the live
        # one's keys miss in this call too, but only the silent server is marked down.
        assert client.get_many([silent[0], live[0]]) == [None, None]
        assert client.counters["server_down"] == 1
        assert client.get(live[0]) == b"v"


@pytest.mark.skipif(not hasattr(socket, "TCP_USER_TIMEOUT"), reason="the OS has no TCP_USER_TIMEOUT")
def test_bytes_unacknowledged_for_the_connect_timeout_end_a_connection(
    make_client: Any, server_thread: Any
) -> None:
    # A cut link leaves a request unacknowledged: the connection then fails after the connect
    # timeout, not the read timeout (tests/fleet and bench/fleet.py cut real links).
    client = make_client(server_thread.host, server_thread.port, timeout=Timeout(30, connect=0.5))
    assert client.get("k") is None
    inner = getattr(client, "inner", client)
    if hasattr(inner, "_pools"):
        conns = [c for c in inner._pools[0]._conns if c is not None]
    else:
        conns = [c for c in inner._lanes[0] if c is not None]
    (conn,) = conns
    assert conn._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 500
