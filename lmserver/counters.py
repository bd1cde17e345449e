"""Every server counter, declared once: the STATS document (stats.py) and the Prometheus
families (metrics.py) are both derived from ``COUNTERS``.

Counting itself stays as cheap as it was: the request path does ``state.counters[name] += n``
on one pre-existing ``defaultdict`` (``ServerState.counters``) by the names declared here, and
connections keep their hottest counts in plain ints until the counters are read
(``LMProtocol.add_counts``). Nothing in this module runs per request.

Each ``Counter`` says where it shows:

* STATS ``"counters"``: every counter, by its name, once it has been counted (a name never
  counted is absent, as it always was);
* ``stats``: a field of the STATS document it also fills (``"hits"``, ``"connections.total"``);
  ``refusal``: part of STATS ``"refusals"``;
* ``family``/``label``: the Prometheus family it is a sample of (``FAMILIES``) and its label
  value there; every counter is also a sample of ``lmserver_events_total{event=<name>}``;
* ``activity``: reported (as a change) in the periodic ``activity`` log line.

A test (tests/ops/test_counters.py) reads lmserver's source and fails on a counter name that
is not declared here.

Per-tier and store fields are the tiers' own (``Tier.usage``, ``MemoryTier.usage``,
``chain.COUNTERS``); ``TIER_GAUGES`` below says which of them are gauges.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from lmproto import Command


@dataclass(frozen=True, slots=True)
class Counter:
    name: str
    """Its key in ``ServerState.counters`` and STATS ``"counters"``."""
    help: str
    stats: str | None = None
    """A STATS field it also fills (a dotted path into the document)."""
    refusal: bool = False
    """Summed into STATS ``"refusals"``."""
    family: str | None = None
    """The Prometheus family (``FAMILIES``) it is a sample of."""
    label: str | None = None
    """Its value of the family's label."""
    activity: bool = False
    """Logged in the periodic ``activity`` line when it changed."""


@dataclass(frozen=True, slots=True)
class Family:
    """A Prometheus counter family made of declared counters (``Counter.family``)."""

    name: str
    help: str
    label: str | None = None
    """Its label's name; None: one sample."""
    always: tuple[str, ...] = ()
    """Label values exported even before they are counted (0), so the family is never empty."""
    other_from: str | None = None
    """A counter of the total: label ``"other"`` is that total less the labelled samples
    (refusals counted without a reason of their own)."""


FAMILIES = (
    Family(
        "lmserver_bad_requests",
        "Requests that could not be served as sent (unknown command, empty or invalid key).",
    ),
    Family(
        "lmserver_object_bytes",
        "Object bytes stored by PUTs and sent by GET hits.",
        label="command",
        always=("put", "get"),
    ),
    Family("lmserver_received_bytes", "Bytes received from clients."),
    Family(
        "lmserver_put_admission_waits",
        "PUTs that waited before being received, by what they waited for (memory held by "
        "objects in use); a PUT still refused after --memory-wait is a no_space refusal.",
        label="reason",
        always=("memory",),
    ),
    Family(
        "lmserver_refusals", "Requests refused, by reason (every command).", label="reason", always=("other",)
    ),
    Family(
        "lmserver_connections_refused",
        "Connections closed at accept, by reason.",
        label="reason",
        other_from="connections_refused",
    ),
)

_REQUEST_REFUSED = "Requests of command {} refused (answered with an error or dropped unread)."


def command_refused(command: int) -> str:
    """The counter of one command's refused requests (``lmserver_requests_total``'s
    ``refused`` outcome). Not a ``refused_*`` reason: STATS counts each refusal once."""
    return f"command_{int(command)}_refused"


COUNTERS: tuple[Counter, ...] = (
    # -- connections (admission.py, connection.py)
    Counter("connections_accepted", "Connections accepted.", stats="connections.total"),
    Counter(
        "connections_refused", "Connections closed at accept (every reason).", stats="connections.refused"
    ),
    *(
        Counter(
            f"connections_refused_{reason}",
            f"Connections closed at accept: {why}.",
            family="lmserver_connections_refused",
            label=reason,
        )
        for reason, why in (
            ("max", "--max-connections open and none idle to displace"),
            ("not_allowed", "the address is not in --allow"),
            ("per_address", "--max-connections-per-address held by that address"),
            ("shutting_down", "the server is shutting down"),
        )
    ),
    Counter("connections_displaced", "Idle connections closed to make room at --max-connections."),
    Counter("tls_handshake_failures", "TLS handshakes that failed or timed out."),
    Counter("idle_closed", "Connections closed after --idle-timeout without a request."),
    Counter("header_timeouts", "Connections dropped: a request header stayed incomplete (--header-timeout)."),
    Counter("body_timeouts", "Connections dropped: a request body stalled (--body-timeout)."),
    Counter("send_timeouts", "Connections dropped: replies stayed unread (--body-timeout)."),
    Counter("bodies_cut_short", "Connections closed by the peer in the middle of a request body."),
    Counter("protocol_errors", "Connections closed on a malformed request header.", activity=True),
    Counter("internal_errors", "Requests that failed on a server error (logged)."),
    # -- requests (connection.py; the hottest are kept in plain ints until read)
    Counter("requests", "Requests served (every command)."),
    Counter("bytes_received", "Bytes received from clients.", family="lmserver_received_bytes"),
    Counter("gets_served", "GETs answered with the object.", stats="hits"),
    Counter("gets_missed", "GETs of a key the server does not hold.", stats="misses"),
    Counter("puts", "Objects stored by PUT and PUT_ACK."),
    Counter("put_bytes", "Object bytes stored by PUTs.", family="lmserver_object_bytes", label="put"),
    Counter("get_bytes", "Object bytes sent by GET hits.", family="lmserver_object_bytes", label="get"),
    Counter(
        "put_waits_memory",
        "PUTs that waited for memory held by objects in use.",
        family="lmserver_put_admission_waits",
        label="memory",
    ),
    Counter(
        "put_waits_tier",
        "PUTs that waited for room in a full=wait tier's queue.",
        family="lmserver_put_admission_waits",
        label="tier",
    ),
    # -- refusals: each refused request counts once in STATS "refusals"
    Counter(
        "bad_requests",
        "Requests that could not be served as sent (unknown command, empty or invalid key).",
        refusal=True,
        family="lmserver_bad_requests",
        activity=True,
    ),
    Counter(
        "refused_no_space",
        "Requests refused: no memory (or tier room) for the object.",
        refusal=True,
        family="lmserver_refusals",
        label="no_space",
        activity=True,
    ),
    Counter(
        "refused_too_large",
        "PUTs refused: the object exceeds --max-object-size or a tier's capacity.",
        refusal=True,
        family="lmserver_refusals",
        label="too_large",
        activity=True,
    ),
    Counter(
        "refused",
        "Requests refused for a reason without a counter of its own.",
        refusal=True,
        family="lmserver_refusals",
        label="other",
        activity=True,
    ),
    *(Counter(command_refused(command), _REQUEST_REFUSED.format(command.name)) for command in Command),
    # -- the metrics endpoint (metrics_endpoint.py)
    Counter("metrics_scrapes", "Scrapes of /metrics answered."),
    Counter("metrics_bad_requests", "Requests to the metrics port that were not a GET or HEAD of /metrics."),
    Counter(
        "metrics_connections_refused", "Connections to the metrics port refused (--allow, or at its limit)."
    ),
    Counter("metrics_connections_displaced", "Metrics connections closed to make room for a newcomer."),
    Counter("metrics_timeouts", "Metrics connections closed: request head or response not done in time."),
)
COUNTER = {counter.name: counter for counter in COUNTERS}

MEMBERS = {family.name: tuple(c for c in COUNTERS if c.family == family.name) for family in FAMILIES}
"""Family name -> its counters, in declaration order."""

REFUSALS = tuple(counter.name for counter in COUNTERS if counter.refusal)
"""The counters STATS ``"refusals"`` adds up: each refused request counts in one of them."""

ACTIVITY = tuple(counter.name for counter in COUNTERS if counter.activity)
"""The counters the periodic ``activity`` line reports when they changed."""

STATS_FIELDS = {counter.stats: counter.name for counter in COUNTERS if counter.stats is not None}
"""STATS field (dotted path) -> the counter that fills it."""


def stats_field(counters: Mapping[str, int], path: str) -> int:
    """The value of the STATS field ``path`` (``STATS_FIELDS``) from the counters."""
    return counters.get(STATS_FIELDS[path], 0)


def refusals(counters: Mapping[str, int]) -> int:
    """STATS ``"refusals"``: requests refused, each once."""
    return sum(counters.get(name, 0) for name in REFUSALS)


def family_samples(family: Family, counters: Mapping[str, int]) -> list[tuple[str | None, int]]:
    """``(label value, value)`` of each sample of ``family``: its counters counted so far (and
    ``family.always``; a family without a label: always), in declaration order; ``"other"``
    last when ``family.other_from``."""
    samples: list[tuple[str | None, int]] = []
    for counter in MEMBERS[family.name]:
        if counter.label is None or counter.name in counters or counter.label in family.always:
            samples.append((counter.label, counters.get(counter.name, 0)))
    if family.other_from is not None:
        total = counters.get(family.other_from, 0)
        samples.append(("other", max(0, total - sum(value for _, value in samples))))
    return samples


TIER_GAUGES = {
    "objects": "Objects the tier holds now.",
    "bytes": "Object bytes the tier holds now.",
    "capacity": "Bytes the tier may hold.",
    "queue_depth": "Writes queued for the tier (write-behind backlog) now.",
    "queue_bytes": "Bytes queued for the tier now.",
    "queue_limit": "Bytes the tier's queue may hold.",
    "reserved_bytes": "Bytes of buffers reserved now (objects and bodies being received).",
    "idle_pool_bytes": "Bytes of idle pool buffers kept for reuse now.",
    "inflight_bytes": "Bytes of transfers in flight now.",
    "pool_mappings": "Memory mappings the pool holds now.",
    "pool_mapped_bytes": "Bytes the pool has mapped now.",
    "metadata_bytes": "Bytes of bookkeeping beside the objects now.",
}
"""Per-tier STATS fields that go up and down, with their help; every other numeric field of a
tier is a counter (``lmserver_tier_<field>_total``), and a true/false field (``healthy``) a
0/1 gauge."""

TIER_GAUGE_NAMES = {"capacity": "capacity_bytes", "queue_limit": "queue_limit_bytes"}
"""Tier gauges whose metric name carries their unit."""
