"""``python -m lmserver`` that must not start: its exit status and its one line of error."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_lmserver(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The server run to its end (it must not serve), without the caller's LMSERVER_* variables."""
    command = [sys.executable, "-m", "lmserver", "--port", "0", "--memory-limit", "64MiB"]
    return subprocess.run(
        [*command, "--log-format", "json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**{k: v for k, v in os.environ.items() if not k.startswith("LMSERVER_")}, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


def the_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line that says what is wrong: a usage error (``Error: ...``) or the "cannot
    start" log line's ``error``. The process exited 2, without a traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = result.stderr.splitlines()
    errors = [line for line in lines if line.startswith("Error:") or "cannot start" in line]
    assert len(errors) == 1, result.stderr
    line = errors[0]
    return str(json.loads(line)["error"]) if line.startswith("{") else line


def startup_error(*args: str) -> str:
    """The error of a server started with ``args``, which must refuse to start."""
    return the_error(run_lmserver(*args))
