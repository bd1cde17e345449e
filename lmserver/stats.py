"""The STATS document and the periodic aggregate log line."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from . import __version__
from .state import ServerState

log = structlog.get_logger("lmserver.stats")


def server_stats(state: ServerState) -> dict[str, Any]:
    """What STATS returns: server facts, connection and request counters, every tier."""
    return {
        "server": "lmserver",
        "version": __version__,
        "uptime_s": round(time.time() - state.started_at, 3),
        "connections": len(state.connections),
        "max_connections": state.config.max_connections,
        "max_object_size": state.config.max_object_size,
        "counters": dict(sorted(state.counters.items())),
        "store": state.store.stats(),
    }


async def log_periodically(state: ServerState, interval: float = 60.0) -> None:
    """One aggregate line per interval with what changed (evictions, refusals, errors):
    operators see the trend without a line per operation."""
    watched = ("evictions", "refusals")
    last: dict[str, int] = {}
    while True:
        await asyncio.sleep(interval)
        memory = state.store.memory.usage()
        now = {name: memory[name] for name in watched}
        now.update({k: v for k, v in state.counters.items() if k.startswith(("refused", "protocol", "bad"))})
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
