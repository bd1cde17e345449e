"""Shared fixtures: real lmserver instances on loopback (port 0, read back).

* ``server_thread`` / ``make_server_thread(**config)``: a server on its own event loop in a
  background thread of the test process (fast; lets tests inspect server state).
* ``spawn_server(*cli_args)``: ``python -m lmserver`` as a subprocess, for signals, SIGKILL and
  restarts on the same port.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lmserver import hardexit
from lmserver.logs import configure_logging
from lmserver.server import ServerThread, raise_fd_limit

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


class ServerProcess:
    """``python -m lmserver`` in a subprocess; stderr (JSON log lines) is collected."""

    def __init__(self, args: tuple[str, ...], port: int = 0, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.host = "127.0.0.1"
        self.port = port
        self.env = env
        self.logs: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        cmd = [sys.executable, "-m", "lmserver", "--host", self.host, "--port", str(self.port)]
        cmd += ["--log-format", "json", *self.args]
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
        )
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 30
        for raw in self.proc.stderr:
            self._record(raw)
            if self.logs and self.logs[-1].get("event") == "listening":
                self.port = int(self.logs[-1]["port"])
                break
            if time.monotonic() > deadline:
                break
        else:
            raise RuntimeError(f"server exited before listening: {self.logs}")
        self._drainer = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._drainer.start()

    def _record(self, raw: bytes) -> None:
        try:
            self.logs.append(json.loads(raw))
        except ValueError:
            self.logs.append({"event": "raw", "text": raw.decode(errors="replace")})

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            self._record(raw)
        proc.stderr.close()

    def _reap(self) -> None:
        """After the process exited: collect its last log lines and close the pipe."""
        self._drainer.join(10)

    def events(self, name: str) -> list[dict[str, Any]]:
        return [line for line in self.logs if line.get("event") == name]

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)
        self._reap()

    def terminate(self, timeout: float = 20) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout)
        self._reap()
        return status

    def restart(self) -> None:
        """Start again on the same port (after kill/terminate)."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        self._start()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.proc is not None:
            self._reap()


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
