"""Prometheus metrics (``--metrics-port``), read from the server's own counters at scrape time.

Strategy:

* The request path only bumps plain integers it already keeps (``ServerState.counters``,
  each connection's ``by_command`` list, the store's and tiers' usage numbers). Nothing
  Prometheus-specific runs per request; a scrape turns those integers into metric families.
* A scrape is served on the event loop (``metrics_endpoint.py``), which owns the numbers: one
  snapshot (the STATS document plus requests by command and the latency buckets) is taken
  and formatted there, no thread and no lock involved.
* The server's counters are declared once in ``counters.py``, with the family and label
  each one is a sample of (``lmserver_refusals_total{reason=...}``, ...); no family is
  assembled by matching names. Every counter is also exported as
  ``lmserver_events_total{event=...}``, declared or not.
* Metrics are derived generically where the source is open-ended: every per-tier numeric
  field becomes ``lmserver_tier_<field>`` (a gauge if declared in ``counters.TIER_GAUGES``,
  else a counter ``..._total``) with a ``tier`` label; every numeric setting
  ``lmserver_config{option=...}``.
* Latency: only requests that are not answered inline (PUT bodies, PUT_ACKs waiting for the
  disk, reads from lower tiers, DELETE) are timed, into fixed buckets of plain ints. Inline
  answers (EXIST, HEALTH, LIST, STATS, memory GETs) take microseconds; they are counted in
  the lowest bucket at scrape time (requests of the command minus timed ones), so the hot
  path never reads a clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lmproto import Command

from . import counters as declared
from .latency import LATENCY_BOUNDS, LatencyRecorder
from .state import ServerState
from .stats import server_stats

TIER_GAUGES = frozenset(declared.TIER_GAUGES)
"""Per-tier fields that go up and down (declared in counters.py)."""


def snapshot(state: ServerState) -> dict[str, Any]:
    """Everything a scrape reports, taken at one instant on the event loop."""
    doc = server_stats(state)
    doc["by_command"] = state.requests_by_command()
    doc["latency"] = state.latency.copy() if state.latency is not None else ({}, {})
    doc["settings"] = {
        f.name: value
        for f in dataclasses.fields(state.config)
        if isinstance(value := getattr(state.config, f.name), int | float) and not isinstance(value, bool)
    }
    return doc


def _command_name(number: int) -> str:
    return Command(number).name.lower()


def _numbers(fields: dict[str, Any]) -> Iterator[tuple[str, int | float]]:
    for name, value in fields.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
            yield name, value


def _flags(fields: dict[str, Any]) -> Iterator[tuple[str, int]]:
    for name, value in fields.items():
        if isinstance(value, bool):
            yield name, int(value)


class ServerCollector(Collector):
    """Builds every lmserver metric family from one snapshot."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterable[Metric]:
        doc = snapshot(self.state)  # on the event loop (metrics_endpoint.py)
        yield from _info(doc)
        yield from _requests(doc)
        yield from _connections(doc)
        yield from _declared(doc["counters"])
        yield from _tiers(doc["tiers"])
        yield from _store(doc["store"])
        yield from _events(doc["counters"])
        yield from _settings(doc["settings"])
        yield from _latency(doc)


def _info(doc: dict[str, Any]) -> Iterator[Metric]:
    info = InfoMetricFamily("lmserver_build", "lmserver version.")
    info.add_metric([], {"version": doc["version"]})
    yield info
    yield GaugeMetricFamily("lmserver_uptime_seconds", "Seconds since the server started.", doc["uptime_s"])


def _requests(doc: dict[str, Any]) -> Iterator[Metric]:
    counters: dict[str, int] = doc["counters"]
    by_command: list[int] = doc["by_command"]
    requests = CounterMetricFamily(
        "lmserver_requests",
        "Requests by command and outcome: hit/miss (GET, EXIST), refused (answered with an error "
        "or dropped unread), ok (served or stored), other (GETs still in flight or failed).",
        labels=["command", "outcome"],
    )
    for command in Command:
        total = by_command[command] if command < len(by_command) else 0
        refused = counters.get(declared.command_refused(command), 0)
        name = _command_name(command)
        if command == Command.GET:
            hits, misses = declared.stats_field(counters, "hits"), declared.stats_field(counters, "misses")
            outcomes = {"hit": hits, "miss": misses, "refused": refused}
            outcomes["other"] = max(0, total - hits - misses - refused)
        elif command == Command.EXIST:
            hits = by_command[0] if by_command else 0
            outcomes = {"hit": hits, "miss": total - hits - refused, "refused": refused}
        else:
            outcomes = {"ok": total - refused, "refused": refused}
        for outcome, value in outcomes.items():
            requests.add_metric([name, outcome], value)
    yield requests


def _declared(counters: dict[str, int]) -> Iterator[Metric]:
    """The families made of declared counters (counters.FAMILIES): refusals, waits, bytes, ..."""
    for family in declared.FAMILIES:
        samples = declared.family_samples(family, counters)
        if family.label is None:
            ((_, value),) = samples
            yield CounterMetricFamily(family.name, family.help, value)
            continue
        metric = CounterMetricFamily(family.name, family.help, labels=[family.label])
        for label, value in samples:
            metric.add_metric([str(label)], value)
        yield metric


def _connections(doc: dict[str, Any]) -> Iterator[Metric]:
    connections = doc["connections"]
    yield GaugeMetricFamily("lmserver_connections", "Connections open now.", connections["current"])
    yield GaugeMetricFamily(
        "lmserver_tls_handshakes",
        "TLS handshakes in progress (each holds a connection slot).",
        connections["handshakes"],
    )
    yield CounterMetricFamily("lmserver_connections_accepted", "Connections accepted.", connections["total"])
    yield GaugeMetricFamily(
        "lmserver_connection_buffer_bytes",
        "Bytes of staging and reply buffers connections hold now (outside the memory limit).",
        connections["buffer_bytes"],
    )


def _tier_rows(tiers: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    """``[{"name": ..., **fields}]`` (STATS) or ``{name: fields}``."""
    if isinstance(tiers, dict):
        yield from tiers.items()
    else:
        for row in tiers:
            yield str(row["name"]), row


def _tiers(tiers: Any) -> Iterator[Metric]:
    families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
    for tier, fields in _tier_rows(tiers):
        for field, value in (*_numbers(fields), *_flags(fields)):
            family = families.get(field)
            if family is None:
                if field in TIER_GAUGES or isinstance(fields[field], bool):
                    name = f"lmserver_tier_{declared.TIER_GAUGE_NAMES.get(field, field)}"
                    help_text = declared.TIER_GAUGES.get(field, f"Tier {field} now.")
                    family = GaugeMetricFamily(name, help_text, labels=["tier"])
                else:
                    family = CounterMetricFamily(f"lmserver_tier_{field}", f"Tier {field}.", labels=["tier"])
                families[field] = family
            family.add_metric([tier], value)
    yield from families.values()


def _store(store: dict[str, Any]) -> Iterator[Metric]:
    """The store's own counters (``lmserver_store_<name>_total``) and its groups of gauges
    (``"chain": {"dirty_bytes": ...}`` becomes ``lmserver_chain_dirty_bytes``)."""
    for field, value in _numbers(store):
        yield CounterMetricFamily(f"lmserver_store_{field}", f"Store {field}.", value)
    for group, fields in store.items():
        if isinstance(fields, dict) and group != "tiers":
            for field, value in _numbers(fields):
                yield GaugeMetricFamily(f"lmserver_{group}_{field}", f"{group} {field} now.", value)


def _events(counters: dict[str, int]) -> Iterator[Metric]:
    events = CounterMetricFamily(
        "lmserver_events",
        "Every server counter by its STATS name (the named metrics above are derived from these).",
        labels=["event"],
    )
    for key, value in sorted(counters.items()):
        events.add_metric([key], value)
    yield events


def _settings(settings: dict[str, int | float]) -> Iterator[Metric]:
    family = GaugeMetricFamily(
        "lmserver_config", "Numeric settings (limits, timeouts) the server runs with.", labels=["option"]
    )
    for name, value in sorted(settings.items()):
        family.add_metric([name], value)
    yield family


def _latency(doc: dict[str, Any]) -> Iterator[Metric]:
    counts, sums = doc["latency"]
    by_command: list[int] = doc["by_command"]
    family = HistogramMetricFamily(
        "lmserver_request_duration_seconds",
        "Server time from a request's header to its reply (or, for PUT, to the object being stored). "
        "Requests answered inline from memory are counted in the lowest bucket.",
        labels=["command"],
    )
    for command in Command:
        timed = counts.get(int(command), [0] * (len(LATENCY_BOUNDS) + 1))
        total = by_command[command] if command < len(by_command) else 0
        inline = max(0, total - sum(timed))
        cumulative, buckets = 0, []
        for i, bound in enumerate((*LATENCY_BOUNDS, float("inf"))):
            cumulative += timed[i] + (inline if i == 0 else 0)
            buckets.append((_bound_label(bound), cumulative))
        family.add_metric([_command_name(command)], buckets, sums.get(int(command), 0.0))
    yield family


def _bound_label(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(bound)


def registry(state: ServerState) -> CollectorRegistry:
    """Every metric of the server: its own, and the process's CPU, RSS and open fds."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(state))
    ProcessCollector(registry=registry)
    return registry


__all__ = ["LATENCY_BOUNDS", "TIER_GAUGES", "LatencyRecorder", "ServerCollector", "registry"]
