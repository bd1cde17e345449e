"""structlog setup: readable on a terminal, JSON lines otherwise (or when asked).

Logging must never stop the server from serving or shutting down: a log line written to a
closed or full stderr (the supervisor went away, a pipe nobody reads) is dropped, not raised
into the signal handler or the connection that logged it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from typing import Any, Literal, TextIO

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
        logger_factory=SafeLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )


class SafeLogger(structlog.PrintLogger):
    """A PrintLogger whose writes never raise: a line that cannot be written is dropped.

    Once the reader is gone (EPIPE) the sink is switched to /dev/null: the file descriptor
    is pointed there, so the interpreter's own flush of stderr at exit (which would turn a
    clean exit into status 120) and every later line cost nothing.
    """

    def msg(self, message: str) -> None:
        try:
            super().msg(message)
        except (BrokenPipeError, ValueError):  # the reader is gone, or the file was closed
            self._give_up()
        except OSError:
            pass  # ENOSPC, EIO: drop this line; a later one may get through

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg

    def _give_up(self) -> None:
        # Not a real file (or already closed): keep dropping lines one by one.
        with self._lock, contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._file.fileno())
            os.close(devnull)
            # What the failed write left buffered now goes to /dev/null, not to a later flush.
            self._file.flush()


class SafeLoggerFactory:
    """structlog logger factory: one SafeLogger over ``file``."""

    def __init__(self, file: TextIO) -> None:
        self._file = file

    def __call__(self, *args: Any) -> SafeLogger:
        return SafeLogger(self._file)


class ThrottledWarnings:
    """Warnings that a misbehaving client or an overloaded tier could repeat thousands of
    times a second: each event is logged at most once per ``interval`` seconds, carrying
    how many were suppressed since (the counters in STATS keep the exact totals)."""

    def __init__(self, logger: Any, interval: float = 10.0) -> None:
        self._log = logger
        self._interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}

    def warning(self, event: str, *, per: str = "", **fields: Any) -> None:
        """Log ``event`` unless it was logged less than ``interval`` ago; ``per`` throttles
        one kind of it apart from the others (say, a tier and the bound it hit)."""
        now = time.monotonic()
        key = f"{event}\0{per}" if per else event
        with self._lock:
            last, suppressed = self._last.get(key, (-self._interval, 0))
            if now - last < self._interval:
                self._last[key] = (last, suppressed + 1)
                return
            self._last[key] = (now, 0)
        self._log.warning(event, suppressed=suppressed, **fields)
