"""Leave the process without native exit handlers when a native library could not shut down.

Why this exists: NIXL's OBJ plugin registers a C ``atexit`` handler (``Aws::ShutdownAPI``)
that waits, forever, until every S3 client is destroyed. The NIXL tier deliberately keeps an
agent alive while a transfer it gave up at a timeout still runs, because destroying it
blocks (with the GIL held) until the hung request dies: about 135 s against an endpoint that
never answers. With such an agent alive, a normal interpreter exit never ends.

So a component that knowingly leaves such state behind calls :func:`require`, and the
process then ends with ``os._exit`` once Python's own exit work is done: the ``atexit``
handler registered here runs before the C handlers, flushes logging and the standard
streams, and exits with the code given to :func:`set_exit_code` (the CLI and the test
suite set it; an embedding program that never does exits with 0). Python ``atexit``
handlers registered before this module was imported are skipped in that case: the cost of
not hanging.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys

import structlog

log = structlog.get_logger("lmserver.hardexit")

_reasons: list[str] = []
_exit_code = 0


def require(reason: str) -> None:
    """Something native cannot be torn down: end the process with ``os._exit`` at exit."""
    if reason not in _reasons:
        _reasons.append(reason)


def set_exit_code(code: int) -> None:
    """The status a hard exit reports (a normal exit reports its own)."""
    global _exit_code
    _exit_code = code


def _exit_now() -> None:
    if not _reasons:
        return
    log.warning("exiting without native cleanup", reasons=_reasons, exit_code=_exit_code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(_exit_code)


atexit.register(_exit_now)
