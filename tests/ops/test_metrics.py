"""/metrics: real HTTP scrapes after a known workload, parsed with prometheus_client's parser."""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from wire import Wire

from lmproto import Command, Generation, Status, decode_json
from lmserver.metrics import LATENCY_BOUNDS, TIER_GAUGES, _tiers
from lmserver.server import ServerThread

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
