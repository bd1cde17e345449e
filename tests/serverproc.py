"""``ServerProcess``: ``python -m lmserver`` as a subprocess (for signals, SIGKILL and restarts
on the same port), shared by the ``spawn_server`` fixture, the namespace fleet (``netfleet``)
and the benchmarks that drive it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any


class ServerProcess:
    """``python -m lmserver`` in a subprocess; stderr (JSON log lines) is collected.

    ``host`` is the address it listens on; ``prefix`` goes before the command (``ip netns
    exec NS`` runs it on a host of a namespace fleet: that execs, so the PID is the server's).
    """

    def __init__(
        self,
        args: tuple[str, ...],
        port: int = 0,
        env: dict[str, str] | None = None,
        *,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
    ) -> None:
        self.args = args
        self.host = host
        self.port = port
        self.env = env
        self.prefix = tuple(prefix)
        self.logs: list[dict[str, Any]] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self._start()

    def _start(self) -> None:
        cmd = [*self.prefix, sys.executable, "-m", "lmserver", "--host", self.host, "--port", str(self.port)]
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
