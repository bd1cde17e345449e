"""Shared fixtures: real lmserver instances on loopback (port 0, read back).

* ``server_thread`` / ``make_server_thread(**config)``: a server on its own event loop in a
  background thread of the test process (fast; lets tests inspect server state).
* ``spawn_server(*cli_args)``: ``python -m lmserver`` as a subprocess, for signals, SIGKILL and
  restarts on the same port.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from serverproc import ServerProcess
from serverthread import ServerThread

from lmserver import hardexit
from lmserver.logs import configure_logging
from lmserver.server import raise_fd_limit

raise_fd_limit()
configure_logging("warning", "json")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    # A NIXL test that cancels a transfer makes the process end by a hard exit
    # (lmserver.hardexit): it must still report the suite's outcome.
    hardexit.set_exit_code(int(exitstatus))


def pytest_unconfigure(config: pytest.Config) -> None:
    # Whatever else hangs interpreter exit (a native library's exit handler, a thread that is
    # joined at exit) fails the run after two minutes instead of stalling CI until its limit.
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(120)


def _config(**overrides: Any) -> Any:
    from lmserver.config import ServerConfig

    settings: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "memory_limit": 256 * 1024**2,
        "log_level": "warning",
        "log_format": "json",
        "shutdown_timeout": 5.0,
    }
    settings.update(overrides)
    return ServerConfig(**settings)


@pytest.fixture
def make_server_thread() -> Iterator[Callable[..., ServerThread]]:
    started: list[ServerThread] = []

    def make(**overrides: Any) -> ServerThread:
        thread = ServerThread(_config(**overrides)).start()
        started.append(thread)
        return thread

    yield make
    for thread in started:
        thread.stop()


@pytest.fixture
def server_thread(make_server_thread: Callable[..., ServerThread]) -> ServerThread:
    return make_server_thread()


@pytest.fixture
def spawn_server(tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    spawned: list[ServerProcess] = []

    def spawn(*args: str, port: int = 0, env: dict[str, str] | None = None) -> ServerProcess:
        if "--memory-limit" not in args:
            args = (*args, "--memory-limit", "256MiB")
        process = ServerProcess(args, port=port, env=env)
        spawned.append(process)
        return process

    yield spawn
    for process in spawned:
        process.stop()


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 16 MiB filesystem (tmpfs, mounted for the test), unmounted afterwards. Request
    it before ``spawn_server`` (or a tier fixture) so that is stopped before the unmount."""
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], check=True)
