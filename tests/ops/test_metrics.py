"""/metrics: real HTTP scrapes after a known workload, parsed with prometheus_client's parser."""

from __future__ import annotations

import concurrent.futures
import http.client
import itertools
import socket
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverthread import ServerThread
from wire import Wire, wait_until

from lmproto import Command, Generation, Status, decode_json
from lmserver.metrics import LATENCY_BOUNDS, TIER_GAUGES, _tiers
from lmserver.metrics_endpoint import MAX_CONNECTIONS

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def counters_of(thread: ServerThread) -> dict[str, int]:
    assert thread.server is not None
    state = thread.server.state
    return thread.call(lambda: dict(state.current_counters()))  # type: ignore[no-any-return]


def test_counts_after_a_known_workload(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread(metrics_port=0, max_object_size=1000)
    assert thread.metrics_port
    with Wire(thread.host, thread.port, Generation.V1) as wire:
        for key, size in (("a", 10), ("b", 20), ("c", 30)):
            wire.put(key, b"x" * size)
        wire.send(Command.PUT, "d", b"y" * 5)  # fire-and-forget
        assert wire.call(Command.EXIST, "d")[0].status == Status.SUCCESS
        assert wire.get("a") == b"x" * 10
        assert wire.get("b") == b"x" * 20
        assert wire.get("nope") is None
        assert wire.call(Command.EXIST, "c")[0].status == Status.SUCCESS
        assert wire.call(Command.EXIST, "nope")[0].status == Status.FAIL
        assert wire.call(Command.PUT_ACK, "big", b"z" * 2000)[0].status == Status.TOO_LARGE
        assert wire.call(Command.HEALTH)[0].status == Status.SUCCESS
        samples = scrape(thread.metrics_port)
        assert decode_json(wire.call(Command.STATS)[1])["refusals"] == 1  # counted once

    requests = "lmserver_requests_total"
    assert value(samples, requests, command="put_ack", outcome="ok") == 3
    assert value(samples, requests, command="put_ack", outcome="refused") == 1
    assert value(samples, requests, command="put", outcome="ok") == 1
    assert value(samples, requests, command="get", outcome="hit") == 2
    assert value(samples, requests, command="get", outcome="miss") == 1
    assert value(samples, requests, command="get", outcome="other") == 0
    assert value(samples, requests, command="exist", outcome="hit") == 2
    assert value(samples, requests, command="exist", outcome="miss") == 1
    assert value(samples, requests, command="health", outcome="ok") == 1
    assert value(samples, requests, command="delete", outcome="ok") == 0
    assert value(samples, "lmserver_object_bytes_total", command="put") == 65
    assert value(samples, "lmserver_object_bytes_total", command="get") == 30
    assert value(samples, "lmserver_refusals_total", reason="too_large") == 1
    assert value(samples, "lmserver_tier_objects", tier="memory") == 4
    assert value(samples, "lmserver_tier_bytes", tier="memory") == 65
    assert value(samples, "lmserver_tier_capacity_bytes", tier="memory") == 256 * 1024**2
    assert value(samples, "lmserver_tier_hits_total", tier="memory") == 2
    assert value(samples, "lmserver_connections") == 1
    assert value(samples, "lmserver_connections_accepted_total") == 1
    assert value(samples, "lmserver_connection_buffer_bytes") >= 65536  # this connection's staging
    assert value(samples, "lmserver_connections_refused_total", reason="other") == 0
    assert value(samples, "lmserver_config", option="max_object_size") == 1000
    # Latency: every request of a command is in its histogram; inline ones in the lowest bucket.
    lowest = repr(LATENCY_BOUNDS[0])
    assert value(samples, "lmserver_request_duration_seconds_count", command="put_ack") == 4
    assert value(samples, "lmserver_request_duration_seconds_count", command="get") == 3
    assert value(samples, "lmserver_request_duration_seconds_bucket", command="get", le=lowest) == 3
    assert value(samples, "lmserver_request_duration_seconds_bucket", command="exist", le="+Inf") == 3
    assert value(samples, "lmserver_request_duration_seconds_sum", command="put_ack") > 0


def test_runs_of_exists_are_counted_hit_by_hit(make_server_thread: Callable[..., ServerThread]) -> None:
    """A connection's EXISTs after its first are answered a run at a time (in C, compiled);
    each one still counts as a hit or a miss."""
    thread = make_server_thread(metrics_port=0)
    with Wire(thread.host, thread.port, Generation.V1) as wire:
        for i in range(0, 120, 3):
            wire.put(f"k{i}", b"v")
        assert wire.call(Command.EXIST, "k0")[0].status == Status.SUCCESS
        wire.send_raw(b"".join(wire.frame(Command.EXIST, f"k{i}") for i in range(120)))
        statuses = [wire.reply()[0].status for _ in range(120)]
        assert statuses == [Status.SUCCESS if i % 3 == 0 else Status.FAIL for i in range(120)]
        for i in range(10):
            expected = Status.SUCCESS if i % 3 == 0 else Status.FAIL
            assert wire.call(Command.EXIST, f"k{i}")[0].status == expected
        samples = scrape(thread.metrics_port)
    assert value(samples, "lmserver_requests_total", command="exist", outcome="hit") == 1 + 40 + 4
    assert value(samples, "lmserver_requests_total", command="exist", outcome="miss") == 80 + 6


def test_closed_connections_still_count(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread(metrics_port=0)
    for _ in range(3):
        with Wire(thread.host, thread.port) as wire:
            wire.call(Command.EXIST, "k")
    with Wire(thread.host, thread.port) as wire:
        wire.call(Command.HEALTH)  # the three closed connections are folded in by now
        samples = scrape(thread.metrics_port)  # type: ignore[arg-type]
    assert value(samples, "lmserver_requests_total", command="exist", outcome="miss") == 3
    assert value(samples, "lmserver_connections_accepted_total") == 4


def test_new_counters_appear_without_code_changes(make_server_thread: Callable[..., ServerThread]) -> None:
    """Counters another part of the server adds (hardening's timeouts, per-address caps)."""
    thread = make_server_thread(metrics_port=0)
    assert thread.server is not None
    counters = thread.server.state.counters

    def bump() -> None:
        counters["idle_timeouts"] += 2
        counters["connections_refused"] += 5
        counters["connections_refused_per_address"] += 5

    thread.call(bump)
    samples = scrape(thread.metrics_port)  # type: ignore[arg-type]
    assert value(samples, "lmserver_events_total", event="idle_timeouts") == 2
    assert value(samples, "lmserver_connections_refused_total", reason="per_address") == 5
    assert value(samples, "lmserver_connections_refused_total", reason="other") == 0


def test_tier_fields_map_generically() -> None:
    tiers: list[dict[str, Any]] = [
        {"name": "memory", "objects": 2, "bytes": 10, "capacity": 100, "hits": 4, "evictions": 1},
        {"name": "disk", "objects": 1, "queue_depth": 3, "queue_bytes": 7, "skipped_writes": 9,
         "demotions": 2, "state": "ok", "healthy": True},
    ]  # fmt: skip
    families = {family.name: family for family in _tiers(tiers)}
    assert families["lmserver_tier_queue_depth"].type == "gauge"
    assert families["lmserver_tier_capacity_bytes"].type == "gauge"
    assert families["lmserver_tier_skipped_writes"].type == "counter"
    assert [(s.labels["tier"], s.value) for s in families["lmserver_tier_objects"].samples] == [
        ("memory", 2),
        ("disk", 1),
    ]
    assert "lmserver_tier_state" not in families  # text fields are not metrics
    assert families["lmserver_tier_healthy"].type == "gauge"
    assert [(s.labels["tier"], s.value) for s in families["lmserver_tier_healthy"].samples] == [("disk", 1)]
    assert {"objects", "bytes", "capacity", "queue_depth", "queue_bytes"} <= TIER_GAUGES


def test_disk_tier_and_write_behind_metrics(
    make_server_thread: Callable[..., ServerThread], tmp_path: Path
) -> None:
    thread = make_server_thread(metrics_port=0, disk=tmp_path / "disk")
    with Wire(thread.host, thread.port) as wire:
        wire.put("k", b"v" * 100)  # PUT_ACK: answered once on disk
        samples = scrape(thread.metrics_port)  # type: ignore[arg-type]
    assert value(samples, "lmserver_tier_objects", tier="disk") == 1
    assert value(samples, "lmserver_tier_queue_bytes", tier="disk") == 0
    assert value(samples, "lmserver_tier_healthy", tier="disk") == 1
    assert value(samples, "lmserver_tier_writes_total", tier="disk") == 1
    assert value(samples, "lmserver_chain_dirty_bytes") == 0
    assert value(samples, "lmserver_request_duration_seconds_count", command="put_ack") == 1


def test_no_metrics_port_no_endpoint(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread()
    assert thread.metrics_port is None
    assert thread.server is not None and thread.server.state.latency is None


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_metrics_host_binds_separately(make_server_thread: Callable[..., ServerThread], loop: str) -> None:
    thread = make_server_thread(metrics_port=0, metrics_host="127.0.0.3", loop=loop)
    with urllib.request.urlopen(f"http://127.0.0.3:{thread.metrics_port}/metrics", timeout=10) as response:
        assert b"lmserver_connections" in response.read()


def test_the_command_line_serves_metrics_from_a_config_file(
    spawn_server: Callable[..., Any], tmp_path: Path
) -> None:
    config = tmp_path / "lmserver.toml"
    config.write_text('metrics-port = 0\nallow = ["127.0.0.0/8"]\n')
    server = spawn_server("--config", str(config))
    listening = server.events("listening")[0]
    assert listening["allow"] == ["127.0.0.0/8"]
    with Wire(server.host, server.port) as wire:
        wire.put("k", b"v")
    samples = scrape(int(listening["metrics_port"]))
    assert value(samples, "lmserver_requests_total", command="put_ack", outcome="ok") == 1


# -- the endpoint: on the event loop, bounded (issue 32, item 3) -----------------------------


def raw_http(port: int, request: bytes, host: str = "127.0.0.1", source: str = "127.0.0.1") -> bytes:
    """Send raw ``request`` bytes; everything the server answers until it closes."""
    with socket.create_connection((host, port), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_only_metrics_is_served(make_server_thread: Callable[..., ServerThread]) -> None:
    port = make_server_thread(metrics_port=0).metrics_port
    assert port
    close = b"Connection: close\r\n\r\n"
    assert raw_http(port, b"GET / HTTP/1.1\r\n" + close).startswith(b"HTTP/1.1 404 ")
    assert raw_http(port, b"GET /metricsx HTTP/1.1\r\n" + close).startswith(b"HTTP/1.1 404 ")
    assert raw_http(port, b"POST /metrics HTTP/1.1\r\n" + close).startswith(b"HTTP/1.1 405 ")
    assert raw_http(port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    huge = b"GET /metrics HTTP/1.1\r\nX: " + b"x" * 9000 + b"\r\n\r\n"
    assert raw_http(port, huge).startswith(b"HTTP/1.1 431 ")
    head = raw_http(port, b"HEAD /metrics HTTP/1.1\r\n" + close)
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")  # no body
    ok = raw_http(port, b"GET /metrics?x=1 HTTP/1.0\r\n\r\n")  # HTTP/1.0: closed after the answer
    assert ok.startswith(b"HTTP/1.1 200 ") and b"lmserver_connections " in ok


def test_scrapes_reuse_a_connection(make_server_thread: Callable[..., ServerThread]) -> None:
    port = make_server_thread(metrics_port=0).metrics_port
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        for _ in range(2):
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            assert response.status == 200 and b"lmserver_build_info" in response.read()
    finally:
        connection.close()


def test_allow_covers_the_metrics_port(make_server_thread: Callable[..., ServerThread]) -> None:
    thread = make_server_thread(metrics_port=0, host="0.0.0.0", allow=("127.0.0.1",))
    port = thread.metrics_port
    assert port
    assert raw_http(port, b"GET /metrics HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")
    assert raw_http(port, b"GET /metrics HTTP/1.0\r\n\r\n", source="127.0.0.2") == b""  # closed at once
    assert counters_of(thread)["metrics_connections_refused"] == 1


def test_a_request_must_come_in_time(
    make_server_thread: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("lmserver.metrics_endpoint.REQUEST_TIMEOUT_S", 0.3)
    thread = make_server_thread(metrics_port=0)
    assert raw_http(thread.metrics_port or 0, b"GET /metr") == b""  # closed by the server, unanswered
    assert counters_of(thread)["metrics_timeouts"] == 1


def test_at_the_cap_a_scrape_displaces_the_longest_waiting_connection(
    make_server_thread: Callable[..., ServerThread],
) -> None:
    thread = make_server_thread(metrics_port=0)
    port = thread.metrics_port or 0
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(MAX_CONNECTIONS)]
    try:
        wait_until(lambda: metrics_connections(thread) == MAX_CONNECTIONS)
        scrape(port)
        assert silent[0].recv(1) == b""  # the one waiting longest made room
        assert counters_of(thread)["metrics_connections_displaced"] == 1
    finally:
        for sock in silent:
            sock.close()


def metrics_connections(thread: ServerThread) -> int:
    assert thread.server is not None and thread.server._metrics is not None
    endpoint = thread.server._metrics
    return thread.call(lambda: len(endpoint._open))  # type: ignore[no-any-return]


def test_concurrent_scrapes_share_one_rendering(
    make_server_thread: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    import lmserver.metrics_endpoint as endpoint

    renderings: list[float] = []
    real = endpoint.generate_latest

    def counted(registry: Any) -> bytes:
        renderings.append(time.monotonic())
        return real(registry)

    monkeypatch.setattr(endpoint, "generate_latest", counted)
    port = make_server_thread(metrics_port=0).metrics_port or 0
    scrape(port)  # the first rendering: at once
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: scrape(port), range(8)))
    assert all(value(r, "lmserver_connections") == 0 for r in results)
    # Renderings are RENDER_INTERVAL_S apart; the 8 scrapes sent together shared one or two.
    assert len(renderings) <= 3
    assert all(b - a >= endpoint.RENDER_INTERVAL_S * 0.99 for a, b in itertools.pairwise(renderings))


def test_the_metrics_port_listens_before_the_lm_port(
    make_server_thread: Callable[..., ServerThread], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A readiness probe that checks both ports must never find lm:// up and /metrics not."""
    import lmserver.server
    from lmserver.metrics_endpoint import MetricsEndpoint

    order: list[str] = []
    listen, start = lmserver.server.listen, MetricsEndpoint.start

    async def lm_listen(*args: Any, **kwargs: Any) -> Any:
        order.append("lm://")
        return await listen(*args, **kwargs)

    async def metrics_start(self: MetricsEndpoint, host: str, port: int) -> None:
        await start(self, host, port)
        order.append("/metrics")

    monkeypatch.setattr(lmserver.server, "listen", lm_listen)
    monkeypatch.setattr(MetricsEndpoint, "start", metrics_start)
    make_server_thread(metrics_port=0)
    assert order == ["/metrics", "lm://"]


def test_silent_sockets_cost_no_threads(spawn_server: Callable[..., Any]) -> None:
    """prometheus_client's server took a thread per connection: 2,000 silent sockets made
    2,002 threads and 2,016 descriptors, forever. Now: no thread, at most MAX_CONNECTIONS."""
    server = spawn_server("--metrics-port", "0")
    port = int(server.events("listening")[0]["metrics_port"])
    process = psutil.Process(server.proc.pid)
    threads, fds = process.num_threads(), process.num_fds()
    silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(200)]
    try:
        scrape(port)  # answered: the scrape displaced a silent socket
        assert process.num_threads() == threads
        assert process.num_fds() <= fds + MAX_CONNECTIONS + 1
    finally:
        for sock in silent:
            sock.close()
