"""Process-level behaviour: CLI forms, health, graceful SIGTERM."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from wire import Wire

from lmproto import Command


def lmcache_server(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmserver", *args], capture_output=True, text=True, timeout=timeout
    )


def test_sigterm_drains_in_flight_put_and_exits_zero(spawn_server) -> None:
    proc = spawn_server("--shutdown-timeout", "10")
    with Wire(proc.host, proc.port) as w:
        body = b"d" * (8 * 1024 * 1024)
        frame = w.frame(Command.PUT_ACK, "draining", body)
        w.send_raw(frame[: 1024 * 1024])  # mid-body when the signal arrives
        time.sleep(0.2)
        proc.proc.send_signal(15)
        time.sleep(0.3)
        assert proc.proc.poll() is None  # still draining us
        w.send_raw(frame[1024 * 1024 :])
        assert w.reply()[0].status == 200
        assert w.is_closed()  # closed after the request in progress
    assert proc.proc.wait(20) == 0
    proc.stop()
    assert proc.events("stopped")


def test_sigterm_with_idle_connections_exits_promptly(spawn_server) -> None:
    proc = spawn_server()
    idle = [Wire(proc.host, proc.port) for _ in range(20)]
    start = time.monotonic()
    assert proc.terminate() == 0
    assert time.monotonic() - start < 5
    for w in idle:
        assert w.is_closed()
        w.close()


def test_upstream_positional_form(spawn_server) -> None:
    proc = spawn_server()
    port = proc.port
    proc.terminate()
    positional = spawn_server("127.0.0.1", str(port), "cpu")
    with Wire(positional.host, positional.port) as w:
        assert w.call(Command.HEALTH)[0].status == 200


def test_health_subcommand(spawn_server) -> None:
    proc = spawn_server()
    ok = lmcache_server("health", "--port", str(proc.port))
    assert ok.returncode == 0 and "healthy" in ok.stdout
    with_stats = lmcache_server("health", "--port", str(proc.port), "--stats")
    assert with_stats.returncode == 0
    assert json.loads(with_stats.stdout[: with_stats.stdout.rindex("}") + 1])["server"] == "lmserver"
    proc.terminate()
    down = lmcache_server("health", "--port", str(proc.port), "--timeout", "1")
    assert down.returncode == 1 and "unhealthy" in down.stderr


def test_help_lists_every_option() -> None:
    out = lmcache_server("serve", "--help").stdout
    for option in [
        "--host",
        "--port",
        "--memory-limit",
        "--max-object-size",
        "--max-connections",
        "--protocol",
        "--log-level",
        "--log-format",
        "--disk",
        "--disk-limit",
        "--fsync",
        "--max-connections-per-address",
        "--idle-timeout",
        "--header-timeout",
        "--body-timeout",
        "LMSERVER_PORT",
        "LMSERVER_BODY_TIMEOUT",
    ]:
        assert option in out, option


def test_bad_sizes_and_forms_are_usage_errors() -> None:
    assert lmcache_server("--memory-limit", "lots").returncode == 2
    assert lmcache_server("127.0.0.1").returncode == 2
    assert lmcache_server("--max-object-size", "3GiB", "--memory-limit", "8GiB").returncode == 2


def test_env_var_defaults(spawn_server) -> None:
    proc = spawn_server(env={"LMSERVER_MAX_CONNECTIONS": "7", "LMSERVER_MEMORY_LIMIT": "32MiB"})
    listening = proc.events("listening")[0]
    assert listening["max_connections"] == 7


def test_upstream_positional_form_with_a_disk_path(spawn_server, tmp_path) -> None:
    probe = spawn_server()
    port = probe.port
    probe.terminate()
    proc = spawn_server("127.0.0.1", str(port), str(tmp_path / "kv"))
    assert proc.events("listening")[0]["disk"] == str(tmp_path / "kv")
    with Wire(proc.host, proc.port) as w:
        w.put("k", b"on disk")
    proc.terminate()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert w.get("k") == b"on disk"


def test_sigterm_exits_zero_after_stderr_is_closed() -> None:
    """Logging never prevents shutdown: the parent closed the read end of stderr, so every
    log line (the "stopping" one inside the signal handler first) meets a broken pipe."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lmserver", "--port", "0", "--log-format", "json", "--memory-limit", "64MiB"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        assert proc.stderr is not None
        port = next(json.loads(line)["port"] for line in proc.stderr if b'"listening"' in line)
        proc.stderr.close()
        with Wire("127.0.0.1", port) as w:  # still serving, with a connection that logs
            w.put("k", b"v")
            assert w.get("k") == b"v"
        proc.send_signal(15)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
