"""The STATS document and the periodic aggregate log line."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import structlog

from . import __version__, compiled
from .counters import ACTIVITY, refusals, stats_field
from .state import ServerState

log = structlog.get_logger("lmserver.stats")


def server_stats(state: ServerState) -> dict[str, Any]:
    """What STATS returns (protocol/SPEC.md 8.9 names the fields clients may rely on); the
    fields made of counters are declared with them (counters.py: ``Counter.stats``)."""
    counters = state.current_counters()
    store = state.store.stats()
    tiers = store.pop("tiers")
    return {
        "server": "lmserver",
        "version": __version__,
        "compiled": native_modules(),  # modules running compiled by mypyc (none: pure Python)
        "uptime_s": round(time.time() - state.started_at, 3),
        "connections": {
            "current": len(state.connections),
            "handshakes": len(state.handshakes),  # TLS handshakes in progress (slots held too)
            "total": stats_field(counters, "connections.total"),
            "refused": stats_field(counters, "connections.refused"),
            "max": state.config.max_connections,
            # Staging and reply buffers, outside --memory-limit (docs/operating.md "Limits and timeouts").
            "buffer_bytes": sum(c.buffer_bytes() for c in state.connections),
        },
        "tiers": [{"name": name, **usage} for name, usage in tiers.items()],
        "hits": stats_field(counters, "hits"),
        "misses": stats_field(counters, "misses"),
        "evictions": list(tiers.values())[-1].get("evictions", 0),
        "refusals": refusals(counters),
        "max_object_size": state.config.max_object_size,
        "counters": dict(sorted(counters.items())),
        "store": store,
    }


def seconds_since_start() -> float | None:
    """Seconds since this process started (Linux: its start time in /proc/self/stat against
    the boot clock, 10 ms resolution), for the ``listening`` line; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime, in ticks
        return round(time.clock_gettime(time.CLOCK_BOOTTIME) - started, 3)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def native_modules() -> list[str]:
    """The modules of a mypyc build that run compiled here (lmserver.compiled())."""
    return sorted(name for name, native in compiled().items() if native)


async def trim_idle_memory(state: ServerState, interval: float = 30.0) -> None:
    """Every ``interval``, return pool buffers that stayed idle the whole time to the OS."""
    while True:
        await asyncio.sleep(interval)
        freed = state.store.trim_idle_memory()
        if freed:
            log.debug("idle object buffers released", bytes=freed)


async def log_periodically(state: ServerState, interval: float = 60.0) -> None:
    """One aggregate line per interval with what changed (evictions, refusals, errors):
    operators see the trend without a line per operation."""
    watched = ("evictions", "refusals")
    last: dict[str, int] = {}
    while True:
        await asyncio.sleep(interval)
        memory = state.store.memory_usage()
        now = {name: memory[name] for name in watched}
        counters = state.current_counters()
        now.update({name: counters[name] for name in ACTIVITY if name in counters})
        now.update(state.store.activity())  # per tier: skipped writes, demotions, failures
        delta = {k: v - last.get(k, 0) for k, v in now.items() if v != last.get(k, 0)}
        last = now
        if delta:
            log.info(
                "activity",
                interval_s=interval,
                connections=len(state.connections),
                memory_objects=memory["objects"],
                memory_bytes=memory["bytes"],
                **delta,
            )
