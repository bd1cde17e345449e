"""The NIXL tier behind a real server: --tier nixl:... (POSIX files, and an S3 bucket shared
by two servers), through the lm:// protocol on loopback."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from startup import startup_error
from tiers.nixl_support import S3Server, obj_spec, s3
from wire import Wire

from lmproto import Command, ObjectMeta, decode_json

__all__ = ["s3"]

KiB = 1024
META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)
pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")


def value(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def nixl_stats(w: Wire) -> dict:
    reply, body = w.call(Command.STATS)
    assert reply.status == 200
    return next(t for t in decode_json(body)["tiers"] if t["name"] == "nixl")


def wait_for(w: Wire, field: str, n: int) -> dict:
    deadline = time.monotonic() + 60  # detects a hang only: writes behind run in the background
    while (st := nixl_stats(w))[field] < n:
        assert time.monotonic() < deadline, st
        time.sleep(0.01)
    return st


def test_posix_tier_behind_memory_survives_a_restart(spawn_server, tmp_path: Path) -> None:
    tier = f"nixl:{tmp_path / 'nx'}?capacity=64MiB&mode=write-behind"
    proc = spawn_server("--tier", tier)
    keys = [f"k{i}" for i in range(20)]
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            w.put(key, value(key, 100 * KiB), META)
        st = wait_for(w, "objects", len(keys))
        assert st["healthy"] and st["errors"] == 0
    assert proc.terminate() == 0
    proc.restart()  # memory starts empty: every GET is served by the NIXL tier and promoted
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            assert w.get(key) == value(key, 100 * KiB), key
        assert nixl_stats(w)["hits"] == len(keys)


def test_two_servers_share_one_bucket(spawn_server, s3: S3Server) -> None:
    bucket = s3.bucket()
    spec = obj_spec(s3, bucket, capacity="64MiB", shared="true", refresh="0.2", mode="write-behind")
    a = spawn_server("--tier", spec)
    b = spawn_server("--tier", spec)
    with Wire(a.host, a.port) as wa, Wire(b.host, b.port) as wb:
        wa.put("shared", value("shared", 300 * KiB), META)
        wait_for(wa, "puts", 1)
        # The Store reads a lower tier only for keys its index holds: b learns a's object
        # from its next listing (every 0.2 s here), then serves it.
        wait_for(wb, "refreshed_in", 1)
        reply, _ = wb.call(Command.EXIST, "shared")
        assert reply.status == 200
        assert wb.get("shared") == value("shared", 300 * KiB)
        assert nixl_stats(wb)["hits"] == 1


def test_a_server_whose_s3_transfer_hung_still_exits(spawn_server, tmp_path: Path) -> None:
    """A transfer cancelled by its timeout leaves its NIXL agent alive on purpose; NIXL's
    OBJ plugin would then wait forever at process exit (lmserver.hardexit)."""
    import socket

    with socket.socket() as blackhole:  # accepts connections, never answers
        blackhole.bind(("127.0.0.1", 0))
        blackhole.listen(64)
        endpoint = f"http://127.0.0.1:{blackhole.getsockname()[1]}"
        spec = (
            f"nixl:s3://never-answers/kv?endpoint={endpoint}&access_key=test&secret_key=test"
            "&timeout=1&capacity=1MiB&mode=write-behind"
        )
        proc = spawn_server("--tier", spec)
        with Wire(proc.host, proc.port) as w:
            w.send(Command.PUT, "k", value("k", 10 * KiB), META)  # written behind: times out
            assert wait_for(w, "timeouts", 1)["healthy"] is False
            assert w.get("k") == value("k", 10 * KiB)  # memory still serves it
        assert proc.terminate(timeout=60) == 0


def test_a_write_behind_bucket_keeps_a_burst_larger_than_memory(spawn_server, s3: S3Server) -> None:
    """60 plain PUTs of 1 MiB through 32 MiB of memory into an S3 tier slower than the
    client, at the remote default full=skip: writes the queue cannot take are skipped and
    counted, and those objects reach the bucket when memory evicts them (clean ones go
    first) or at the clean stop. A fresh server serves all 60 from the bucket."""
    spec = obj_spec(s3, s3.bucket(), capacity="1GiB", mode="write-behind")
    proc = spawn_server("--tier", spec, "--memory-limit", "32MiB")
    keys = [f"burst{i}" for i in range(60)]
    with Wire(proc.host, proc.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, k, value(k, 1024 * KiB), META) for k in keys))
        assert w.get(keys[-1]) == value(keys[-1], 1024 * KiB)
        _reply, body = w.call(Command.STATS)
        memory = decode_json(body)["tiers"][0]
        assert memory["demotions_dropped"] == 0, memory
    assert proc.terminate(timeout=60) == 0
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            assert w.get(key) == value(key, 1024 * KiB), key


def test_a_bucket_that_does_not_exist_is_a_startup_error(s3: S3Server) -> None:
    """It printed a ~40-line traceback and exited 1."""
    spec = obj_spec(s3, "no-such-bucket", capacity="1MiB")
    error = startup_error("--tier", spec)
    assert error.startswith("--tier nixl:s3://no-such-bucket/") and "secret_key=***" in error


def test_a_directory_another_server_uses_is_a_startup_error(spawn_server, tmp_path: Path) -> None:
    spec = f"nixl:{tmp_path / 'nx'}?capacity=1MiB"
    spawn_server("--tier", spec)
    error = startup_error("--tier", spec)
    assert error.startswith(f"--tier {spec}: ") and "in use" in error


def test_an_object_too_large_for_a_slot_is_counted_once(spawn_server, tmp_path: Path) -> None:
    """Objects larger than a slot are declined by the write behind, then again when memory
    evicts them (the demotion): the static pool's declined_too_large counted each twice."""
    tier = f"nixl:{tmp_path / 'nx'}?layout=static&slot_size=64KiB&slots=4&mode=write-behind"
    proc = spawn_server("--memory-limit", "4MiB", "--tier", tier)
    with Wire(proc.host, proc.port) as w:
        for i in range(60):  # 6 MiB through 4 MiB of memory: some are evicted and offered again
            w.send(Command.PUT, f"big{i}", value(f"big{i}", 100 * KiB), META)
        st = wait_for(w, "write_failures", 61)  # 60 write-behinds and at least one demotion
        deadline = time.monotonic() + 60  # detects a hang only
        while (st := nixl_stats(w))["queue_depth"]:  # every write and demotion tried
            assert time.monotonic() < deadline, st
            time.sleep(0.01)
        assert st["declined_too_large"] == 60 < st["write_failures"], st
