"""Targets: servers the bench starts itself (lmserver, redis-local, the raw limit peer) or is given.

Strategy: a managed server is a child process started with stderr to a log file under the
run's output folder (no pipe to fill up); the bench learns its port from lmserver's JSON
``listening`` log line, or picks a free port itself when that is not available. Only PIDs
the bench started are ever signalled. For targets given by URL on a loopback address, the
server PID is looked up from the listening socket so CPU and RSS can still be sampled.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import psutil

from lmproto import REPLY_SIZE, Command, Generation, encode_request

from .drivers import RespDriver, TargetSpec, probe_put_ack

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Target:
    name: str  # label in tables and plots, e.g. "lmserver", "lmserver+disk", "redis-local"
    spec: TargetSpec | None
    pid: int | None = None
    note: str = ""
    managed: Any = None  # Popen or multiprocessing Process we started
    stop_conn: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def skipped(self) -> bool:
        return self.spec is None

    def describe(self) -> dict[str, Any]:
        spec = self.spec
        return {
            "name": self.name,
            "kind": spec.kind if spec else None,
            "address": f"{spec.host}:{spec.port}" if spec else None,
            "generation": spec.generation if spec and spec.kind != "resp" else None,
            "put_ack": spec.put_ack if spec and spec.kind != "resp" else None,
            "server_pid": self.pid,
            "skipped": self.skipped,
            "note": self.note,
            **self.extra,
        }

    def stop(self) -> None:
        proc = self.managed
        if proc is None:
            return
        if isinstance(proc, subprocess.Popen):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        else:
            with contextlib.suppress(OSError):
                self.stop_conn.send(None)
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.managed = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_connectable(host: str, port: int, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.05)
    return False


def _listening_record(log: Path, proc: subprocess.Popen[bytes], timeout: float) -> dict[str, Any] | None:
    """The server's JSON ``{"event": "listening", "port": N, ...}`` line on stderr, parsed."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if '"listening"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    rec = json.loads(line[line.index("{") :])
                    if rec.get("event") == "listening" and rec.get("port"):
                        return dict(rec)
        if proc.poll() is not None:
            return None
        time.sleep(0.05)
    return None


FROM_SOURCE = (
    "runs from source, no module compiled (a pure build, LMSERVER_PURE=1, or a stale build: see its log)"
)
"""The note of an lmserver whose listening line lists no compiled module: its figures are not
the compiled server's. A build gone stale by an edit (or a ``git stash``) after it was made
runs this way with only a warning in its log, easy to miss in a benchmark's output."""


def _tail(path: Path, n: int = 3) -> str:
    with contextlib.suppress(OSError):
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
        return " | ".join(lines[-n:])[-400:]
    return ""


def lmserver_available(cmd: str | None) -> str | None:
    """None if lmserver can be started, else the reason it cannot."""
    if cmd:
        return None
    if not (REPO / "lmserver" / "__main__.py").exists():
        return "lmserver/__main__.py does not exist yet"
    return None


def baseline_command(checkout: Path, wrapper: Sequence[str] = ()) -> str:
    """The command line that runs the lmserver of another checkout (built in place: ``python
    setup.py build_ext --inplace``) with this interpreter and its packages: the checkout's
    ``lmserver`` and ``lmproto`` first on the path, and ``python -P`` so that the current
    directory's do not come before them. ``wrapper`` goes in front of the interpreter (valgrind).
    SystemExit if ``checkout`` is not an lmserver checkout."""
    if not (checkout / "lmserver" / "__main__.py").is_file():
        raise SystemExit(f"--baseline {checkout}: not an lmserver checkout")
    path = os.pathsep.join([str(checkout), str(checkout / "protocol")])
    return shlex.join(["env", f"PYTHONPATH={path}", *wrapper, sys.executable, "-P", "-m", "lmserver"])


def start_lmserver(
    name: str, out: Path, cmd: str | None, extra_args: list[str], memory_limit: str, startup: float = 30.0
) -> Target:
    """Start ``python -m lmserver`` (or ``cmd``) on 127.0.0.1; Target.spec is None if it failed."""
    reason = lmserver_available(cmd)
    if reason:
        return Target(name, None, note=f"skipped: {reason}")
    base = shlex.split(cmd) if cmd else [sys.executable, "-m", "lmserver"]
    log = out / f"{name}.log"
    common = ["--host", "127.0.0.1", "--log-format", "json", "--memory-limit", memory_limit, *extra_args]

    def launch(port: int) -> subprocess.Popen[bytes]:
        with log.open("ab") as fh:
            return subprocess.Popen(
                [*base, "--port", str(port), *common],
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=fh,
                cwd=REPO,
                start_new_session=True,
            )

    log.write_bytes(b"")
    proc = launch(0)
    listening = _listening_record(log, proc, startup)
    port = None if listening is None else int(listening["port"])
    note = FROM_SOURCE if listening is not None and listening.get("compiled") == [] else ""
    if port is None:
        rc = proc.poll()
        if rc is None:
            proc.terminate()
            proc.wait(10)
        if rc is not None and rc != 0 and extra_args and "no such option" in _tail(log, 20).lower():
            return Target(name, None, note=f"skipped: server rejected {' '.join(extra_args)}: {_tail(log)}")
        # No listening line: choose the port ourselves and wait until it accepts.
        port = free_port()
        proc = launch(port)
        if not _wait_connectable("127.0.0.1", port, proc, startup):
            rc = proc.poll()
            if rc is None:
                proc.kill()
                proc.wait(5)
            return Target(name, None, note=f"skipped: server did not start (rc={rc}): {_tail(log)}")
        note = "port chosen by the bench (no JSON listening line)"
    put_ack = probe_put_ack("127.0.0.1", port, 0)
    spec = TargetSpec("lm", "127.0.0.1", port, 0, put_ack)
    if not put_ack:
        note = (note + "; " if note else "") + "no PUT_ACK reply: sequential PUT uses PUT+EXIST"
    extra: dict[str, Any] = {"log": str(log)}
    if listening is not None and "startup_s" in listening:
        extra["startup_s"] = listening["startup_s"]  # process start to listening, as it measured
    return Target(name, spec, pid=proc.pid, note=note, managed=proc, extra=extra)


def start_redis_local(out: Path, startup: float = 10.0, wrapper: Sequence[str] = ()) -> Target:
    """Start redis-server on 127.0.0.1, persistence off; ``wrapper`` prefixes its command line
    (bench.instructions runs it under valgrind)."""
    exe = shutil.which("redis-server")
    if exe is None:
        return Target("redis-local", None, note="skipped: redis-server is not on PATH")
    port = free_port()
    log = out / "redis-local.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            [*wrapper, exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdin=subprocess.DEVNULL,
            stdout=fh,
            stderr=fh,
            cwd=out,
            start_new_session=True,
        )
    if not _wait_connectable("127.0.0.1", port, proc, startup):
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        return Target("redis-local", None, note=f"skipped: redis-server did not start: {_tail(log)}")
    spec = TargetSpec("resp", "127.0.0.1", port)
    ver = ""
    with contextlib.suppress(Exception):
        ver = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=5).stdout.strip()
    return Target("redis-local", spec, pid=proc.pid, managed=proc, extra={"version": ver, "log": str(log)})


def prime_store(host: str, port: int, size: int) -> None:
    """One PUT_ACK of ``size`` bytes, so the store limit builds (and touches) its ring of
    buffers for that size before any timed cell."""
    with socket.create_connection((host, port), timeout=60) as sock:
        sock.sendall(encode_request(Command.PUT_ACK, "prime", size))
        sock.sendall(bytes(size))
        reply = b""
        while len(reply) < REPLY_SIZE[Generation.V0]:
            chunk = sock.recv(REPLY_SIZE[Generation.V0] - len(reply))
            if not chunk:
                raise ConnectionError("store limit closed the connection")
            reply += chunk


def start_raw(name: str = "phys", ring_bytes: int = 0) -> Target:
    """The raw peer; ``ring_bytes`` > 0 makes it the store limit (see rawserver)."""
    from .rawserver import serve

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=serve, args=(child, ring_bytes), name=f"bench-raw-{name}", daemon=True)
    proc.start()
    child.close()
    if not parent.poll(30):
        proc.kill()
        return Target(name, None, note="skipped: raw limit server did not start")
    port = parent.recv()
    spec = TargetSpec("raw", "127.0.0.1", port, 0, True)
    return Target(name, spec, pid=proc.pid, managed=proc, stop_conn=parent)


def find_listener_pid(host: str, port: int) -> int | None:
    """PID listening on a loopback ``host:port``, if this user may see it."""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, port)}
    except OSError:
        return None
    if not any(a.startswith("127.") or a == "::1" for a in addrs):
        return None
    with contextlib.suppress(psutil.Error, OSError):
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                return int(c.pid)
    return None


def given_target(url: str) -> Target:
    """``lm://HOST:PORT[?v=0|1]`` or ``redis://HOST:PORT`` from the command line."""
    u = urlparse(url)
    host = u.hostname or "127.0.0.1"
    if u.scheme == "redis":
        port = u.port or 6379
        spec = TargetSpec("resp", host, port)
        try:
            d = RespDriver(spec)
            ok = d.ping()
            d.close()
        except OSError as exc:
            return Target(url, None, note=f"skipped: cannot reach {url}: {exc}")
        if not ok:
            return Target(url, None, note=f"skipped: {url} did not answer PING")
        return Target(url, spec, pid=find_listener_pid(host, port), note="writes keys lmbench@*")
    if u.scheme == "lm":
        port = u.port or 65432
        gen = int(parse_qs(u.query).get("v", ["0"])[0])
        try:
            socket.create_connection((host, port), timeout=5).close()
        except OSError as exc:
            return Target(url, None, note=f"skipped: cannot reach {url}: {exc}")
        ack = probe_put_ack(host, port, gen)
        note = "" if ack else "no PUT_ACK reply: sequential PUT uses PUT+EXIST"
        return Target(
            url, TargetSpec("lm", host, port, gen, ack), pid=find_listener_pid(host, port), note=note
        )
    return Target(url, None, note=f"skipped: unknown target scheme in {url!r}")


def server_sample(pid: int | None) -> tuple[float, int] | None:
    """(CPU seconds user+system, RSS bytes) of a server process, or None."""
    if pid is None:
        return None
    try:
        p = psutil.Process(pid)
        t = p.cpu_times()
        return t.user + t.system, p.memory_info().rss
    except psutil.Error:
        return None


def disk_dir_usage(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, f)).st_size
    return total
