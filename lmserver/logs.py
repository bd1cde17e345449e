"""structlog setup: readable on a terminal, JSON lines otherwise (or when asked)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import Any, Literal

import structlog


def configure_logging(level: str = "info", fmt: Literal["auto", "console", "json"] = "auto") -> None:
    numeric = logging.getLevelNamesMapping().get(level.upper())
    if numeric is None:
        raise ValueError(f"unknown log level {level!r}")
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if use_json else structlog.processors.StackInfoRenderer(),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class ThrottledWarnings:
    """Warnings that a misbehaving client or an overloaded tier could repeat thousands of
    times a second: each event is logged at most once per ``interval`` seconds, carrying
    how many were suppressed since (the counters in STATS keep the exact totals)."""

    def __init__(self, logger: Any, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, event: str, **fields: Any) -> None:
        now = time.monotonic()
        with self._lock:
            last, suppressed = self._last.get(event, (-self._interval, 0))
            if now - last < self._interval:
                self._last[event] = (last, suppressed + 1)
                return
            self._last[event] = (now, 0)
        self._log.warning(event, suppressed=suppressed, **fields)
