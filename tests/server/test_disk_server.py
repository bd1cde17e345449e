"""The disk tier behind memory, through a real server process: restarts, SIGKILL, corruption,
capacity, hostile keys, and a data set larger than memory."""

from __future__ import annotations

import hashlib
import os
import random
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from disktier import allocated, flip_byte, record_on_disk
from wire import Wire

from lmproto import Command, decode_json, decode_key_lines

KiB = 1024
MiB = 1024 * KiB


def value(key: str, size: int = 1000) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def put_many(w: Wire, keys: list[str], size: int = 1000) -> None:
    """Pipelined PUT_ACKs, then all the acknowledgements."""
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        w.send_raw(b"".join(w.frame(Command.PUT_ACK, k, value(k, size)) for k in chunk))
        for _ in chunk:
            assert w.reply()[0].status == 200


def get_many(w: Wire, keys: list[str]) -> list[bytes | None]:
    out: list[bytes | None] = []
    for start in range(0, len(keys), 500):
        chunk = keys[start : start + 500]
        w.send_raw(b"".join(w.frame(Command.GET, k) for k in chunk))
        for _ in chunk:
            reply, body = w.reply()
            out.append(body if reply.status == 200 else None)
    return out


def stats(w: Wire) -> dict:
    return decode_json(w.call(Command.STATS)[1])


def disk_tier(st: dict) -> dict:
    return next(t for t in st["tiers"] if t["name"] == "disk")


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_restart_serves_ten_thousand_objects_in_lru_order(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = [f"model@1@0@{i:05x}@half" for i in range(10_000)]
    proc = spawn_server("--disk", str(data), "--disk-limit", "64MiB", "--memory-limit", "8MiB")
    with Wire(proc.host, proc.port) as w:
        put_many(w, keys)
        assert get_many(w, keys[:100]) == [value(k) for k in keys[:100]]  # the first 100 are now hot
    assert proc.terminate() == 0
    # Same data, a disk limit that holds only ~half: what goes first must be the LRU half.
    proc = spawn_server("--disk", str(data), "--disk-limit", "6MiB", "--memory-limit", "8MiB")
    restarted = proc
    with Wire(restarted.host, restarted.port) as w:
        got = get_many(w, keys)
        present = [k for k, v in zip(keys, got, strict=True) if v is not None]
        assert all(v == value(k) for k, v in zip(keys, got, strict=True) if v is not None)
        assert set(keys[:100]) <= set(present)  # hot before the restart, kept
        assert keys[100] not in present  # cold and oldest, evicted
        assert keys[-1] in present
    restarted.terminate()
    proc = spawn_server("--disk", str(data), "--disk-limit", "64MiB", "--memory-limit", "8MiB")
    with Wire(proc.host, proc.port) as w:
        assert set(decode_key_lines(w.call(Command.LIST)[1])) == set(present)


def test_full_restart_is_byte_identical(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = [f"k{i}" for i in range(10_000)]
    proc = spawn_server("--disk", str(data), "--disk-limit", "64MiB")
    with Wire(proc.host, proc.port) as w:
        put_many(w, keys, 700)
    proc.kill()  # not even a clean shutdown
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert get_many(w, keys) == [value(k, 700) for k in keys]


def test_sigkill_while_streaming_puts(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    # The disk limit holds everything written, so no acknowledged object may be evicted.
    proc = spawn_server("--disk", str(data), "--disk-limit", "1GiB", "--fsync", "never")
    acked: list[str] = []
    stop = threading.Event()

    def acked_writer() -> None:
        with Wire(proc.host, proc.port) as w:
            i = 0
            while not stop.is_set():
                key = f"ack{i}"
                try:
                    reply, _ = w.call(Command.PUT_ACK, key, value(key, 64 * KiB))
                except OSError:
                    return
                if reply.status == 200:
                    acked.append(key)
                i += 1

    def blind_writer() -> None:
        with Wire(proc.host, proc.port) as w:
            i = 0
            while not stop.is_set() and i < 2000:  # at most ~400 MiB, ~100 MB/s
                try:
                    w.send(Command.PUT, f"ff{i}", value(f"ff{i}", 200 * KiB))
                except OSError:
                    return
                i += 1
                time.sleep(0.002)

    threads = [threading.Thread(target=acked_writer), threading.Thread(target=blind_writer)]
    for t in threads:
        t.start()
    time.sleep(2)
    proc.kill()
    stop.set()
    for t in threads:
        t.join(10)
    assert len(acked) >= 5  # some PUT_ACKs were answered before the kill
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        keys = decode_key_lines(w.call(Command.LIST)[1])
        assert set(acked) <= set(keys)
        got = get_many(w, keys)
        # What the killed run left half-written was given back at open: the segments hold
        # exactly what the index counts.
        assert allocated(data) == disk_tier(stats(w))["bytes"]
    for key, body in zip(keys, got, strict=True):
        size = 64 * KiB if key.startswith("ack") else 200 * KiB
        assert body == value(key, size), key  # nothing torn or mixed is ever served


def versioned(key: str, version: int, size: int = 8 * KiB) -> bytes:
    """Every version of a key has the same size and different bytes."""
    head = f"{key}:{version}:".encode()
    return head + value(f"{key}/{version}", size - len(head))


class AckedWriter(threading.Thread):
    """Overwrites its keys in pipelined PUT_ACK bursts until the server dies; records the
    last version sent and the last version acknowledged for each key."""

    def __init__(self, proc, keys: list[str], version: int) -> None:
        super().__init__()
        self.proc, self.keys, self.version = proc, keys, version
        self.sent: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        self.passes = 0

    def run(self) -> None:
        try:
            with Wire(self.proc.host, self.proc.port) as w:
                while True:
                    self.version += 1
                    w.send_raw(
                        b"".join(w.frame(Command.PUT_ACK, k, versioned(k, self.version)) for k in self.keys)
                    )
                    self.sent.update(dict.fromkeys(self.keys, self.version))
                    for k in self.keys:
                        if w.reply()[0].status == 200:
                            self.acked[k] = self.version
                    self.passes += 1
        except OSError:  # the kill
            return


@pytest.mark.parametrize("fsync", ["never", "always"])
def test_acknowledged_overwrites_survive_sigkill_loops(spawn_server, tmp_path: Path, fsync: str) -> None:
    """The first GET after a SIGKILL serves the last acknowledged version (or a newer one
    sent after it), never a miss or an older version. Every second round holds SQLite's
    write lock from outside, as a slow index disk would: the object files then run ahead of
    their index rows at the kill, and same-size overwrites leave stale rows behind."""
    data = tmp_path / "data"
    keys = [f"crash{i}" for i in range(48)]
    rng = random.Random(f"sigkill-{fsync}")
    proc = spawn_server("--disk", str(data), "--disk-limit", "1GiB", "--fsync", fsync)
    sent: dict[str, int] = {}
    acked: dict[str, int] = {}
    version = 0
    for rnd in range(4):
        lock = None
        if rnd % 2:
            lock = sqlite3.connect(data / "index.sqlite3", isolation_level=None, timeout=30)
            lock.execute("BEGIN IMMEDIATE")
        writers = [AckedWriter(proc, keys[i::3], version + i * 1_000_000) for i in range(3)]
        for t in writers:
            t.start()
        deadline = time.monotonic() + 60
        while min(t.passes for t in writers) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.3))
        proc.kill()
        for t in writers:
            t.join(10)
            sent.update(t.sent)
            acked.update(t.acked)
        version += 10_000_000
        if lock is not None:
            lock.execute("ROLLBACK")
            lock.close()
        assert all(k in acked for k in keys), f"round {rnd}: every key acknowledged before the kill"
        proc.restart()
        with Wire(proc.host, proc.port) as w:
            got = get_many(w, keys)  # the first GET of each key after the restart
            assert disk_tier(stats(w))["corrupt"] == 0
        for key, body in zip(keys, got, strict=True):
            assert body is not None, f"round {rnd}: acknowledged {key} v{acked[key]} read as a miss"
            got_version = int(body.split(b":")[1])
            assert acked[key] <= got_version <= sent[key], (rnd, key, acked[key], got_version, sent[key])
            assert body == versioned(key, got_version), (rnd, key)


def stop_and_flip_a_byte(proc, data: Path, key: str, size: int) -> None:
    assert proc.terminate() == 0
    path, offset, header_len = record_on_disk(data, key)
    flip_byte(path, offset + header_len + size - 10)


def test_flipped_byte_is_a_miss_not_wrong_data(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data))
    with Wire(proc.host, proc.port) as w:
        w.put("precious", value("precious", 100 * KiB))
    stop_and_flip_a_byte(proc, data, "precious", 100 * KiB)
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert w.get("precious") is None
        assert disk_tier(stats(w))["corrupt"] == 1
        assert w.call(Command.EXIST, "precious")[0].status == 400


def test_lost_index_is_rebuilt_from_files(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = [f"r{i}" for i in range(500)]
    proc = spawn_server("--disk", str(data))
    with Wire(proc.host, proc.port) as w:
        put_many(w, keys)
    assert proc.terminate() == 0
    for index_file in data.glob("index.sqlite3*"):
        index_file.unlink()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert get_many(w, keys) == [value(k) for k in keys]


def test_disk_usage_stays_under_limit(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    limit = 8 * MiB
    proc = spawn_server("--disk", str(data), "--disk-limit", str(limit), "--memory-limit", "4MiB")
    with Wire(proc.host, proc.port) as w:
        for i in range(96):  # 3x the limit in 256 KiB objects
            w.put(f"d{i}", value(f"d{i}", 256 * KiB))
            assert allocated(data) <= limit
        tier = disk_tier(stats(w))
        assert tier["bytes"] <= limit and tier["evictions"] > 0
        assert w.get("d95") == value("d95", 256 * KiB)


def test_hostile_keys_stay_inside_the_data_directory(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    keys = ["../../escape", "/etc/passwd", "a/b/../../c", "..", "tab\there", "bell\x07\x1b[0m", "é" * 75]
    proc = spawn_server("--disk", str(data), "--memory-limit", "1MiB")
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            w.put(key, value(key, 300 * KiB))  # larger than memory can keep: all on disk
    proc.terminate()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            assert w.get(key) == value(key, 300 * KiB), key
    root = data.resolve()
    for path in tmp_path.rglob("*"):
        if path.is_file():
            assert path.resolve().is_relative_to(root) or path.parent == tmp_path
    assert not (tmp_path / "escape").exists()


def test_data_set_larger_than_memory_is_served_from_disk(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data), "--memory-limit", "8MiB", "--disk-limit", "128MiB")
    keys = [f"big{i}" for i in range(40)]
    with Wire(proc.host, proc.port) as w:
        for key in keys:  # 40 MiB through 8 MiB of memory, acknowledged and pipelined
            w.send(Command.PUT_ACK, key, value(key, MiB))
        assert all(w.reply()[0].status == 200 for _ in keys)
        for key in keys:
            assert w.get(key) == value(key, MiB), key
        assert w.call(Command.EXIST_MANY, "", b"".join(bytes([len(k)]) + k.encode() for k in keys))[1] == (
            b"\x01" * 40
        )
        st = stats(w)
        assert st["tiers"][1]["promotions"] > 0
        assert st["tiers"][0]["bytes"] <= 8 * MiB
        # DELETE acts on every tier.
        assert w.call(Command.DELETE, "big0")[0].status == 200
        assert w.get("big0") is None
    proc.terminate()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert w.get("big0") is None
        assert w.get("big1") == value("big1", MiB)


def test_overwrite_reaches_disk_in_order(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data), "--memory-limit", "4MiB")
    with Wire(proc.host, proc.port) as w:
        for version in range(29):  # best effort: some of these writes are skipped
            w.send(Command.PUT, "hot", value(f"v{version}", 512 * KiB))
        w.put("hot", value("v29", 512 * KiB))  # acknowledged: on disk, after every older one
        assert w.get("hot") == value("v29", 512 * KiB)
    assert proc.terminate() == 0
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert w.get("hot") == value("v29", 512 * KiB)


def test_no_leftover_space_after_clean_stop(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data), "--disk-limit", "1MiB")
    with Wire(proc.host, proc.port) as w:
        put_many(w, [f"t{i}" for i in range(50)], size=64 * KiB)  # 3x the limit
        held = disk_tier(stats(w))["bytes"]
    proc.terminate()
    assert allocated(data) == held <= MiB  # every evicted record given back before the exit
    assert os.path.exists(data / "index.sqlite3")


def test_replies_stay_in_order_behind_pending_acks(spawn_server, tmp_path: Path) -> None:
    proc = spawn_server("--disk", str(tmp_path / "data"), "--fsync", "always")
    with Wire(proc.host, proc.port) as w:
        burst = b""
        for i in range(50):
            burst += w.frame(Command.PUT_ACK, f"o{i}", value(f"o{i}"))
            burst += w.frame(Command.GET, f"o{i}")  # visible at once, answered after the ack
            burst += w.frame(Command.EXIST, f"o{i + 1}")  # not yet stored
        w.send_raw(burst)
        for i in range(50):
            ack, get, exist = w.reply(), w.reply(), w.reply()
            assert (ack[0].status, ack[1]) == (200, b"")
            assert (get[0].status, get[1]) == (200, value(f"o{i}"))
            assert exist[0].status == 400


def test_runs_of_exists_wait_behind_a_pending_ack(spawn_server, tmp_path: Path) -> None:
    """EXISTs after EXISTs are answered a run at a time; behind a PUT_ACK that waits for the
    disk, their replies are held in order like every other reply."""
    proc = spawn_server("--disk", str(tmp_path / "data"), "--fsync", "always")
    with Wire(proc.host, proc.port) as w:
        w.put("here", value("here"))
        burst = b""
        for i in range(20):
            burst += w.frame(Command.EXIST, "here") + w.frame(Command.EXIST, f"a{i}")
            burst += w.frame(Command.PUT_ACK, f"a{i}", value(f"a{i}"))
            burst += w.frame(Command.EXIST, f"a{i}") + w.frame(Command.EXIST, f"a{i + 1}")
        w.send_raw(burst)
        for i in range(20):
            got = [w.reply() for _ in range(5)]
            assert [(reply.status, body) for reply, body in got] == [
                (200, b""),
                (400, b""),  # not stored yet
                (200, b""),  # the acknowledgement, once on disk
                (200, b""),
                (400, b""),
            ], i


def test_replies_queued_before_a_pending_ack_go_before_it(spawn_server, tmp_path: Path) -> None:
    """Small replies are copied into a buffer that is written at the end of the read; a
    PUT_ACK whose reply must wait for the disk holds every reply after it, and none before it."""
    proc = spawn_server("--disk", str(tmp_path / "data"), "--fsync", "always")
    with Wire(proc.host, proc.port) as w:
        w.put("small", value("small"))
        w.put("large", value("large", 64 * KiB))  # above small_reply: zero-copy, pinned
        burst = w.frame(Command.GET, "small") + w.frame(Command.EXIST, "small")
        burst += w.frame(Command.PUT_ACK, "acked", value("acked"))
        burst += w.frame(Command.GET, "small") + w.frame(Command.GET, "large") + w.frame(Command.GET, "acked")
        burst += w.frame(Command.HEALTH)
        w.send_raw(burst)
        got = [w.reply() for _ in range(7)]
        assert [(reply.status, body) for reply, body in got] == [
            (200, value("small")),
            (200, b""),
            (200, b""),  # the acknowledgement, once on disk
            (200, value("small")),
            (200, value("large", 64 * KiB)),
            (200, value("acked")),
            (200, b""),
        ]


def test_second_server_on_the_same_disk_folder_refuses_to_start(spawn_server, tmp_path: Path) -> None:
    data = tmp_path / "data"
    spawn_server("--disk", str(data))
    second = subprocess.run(
        [sys.executable, "-m", "lmserver", "--port", "0", "--disk", str(data), "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 2  # a startup error, one line naming the option
    assert "cannot start" in second.stderr and "--disk" in second.stderr and "in use" in second.stderr


def test_sigterm_answers_what_it_received_then_closes_cleanly(spawn_server, tmp_path: Path) -> None:
    """Graceful stop: requests already received are served and acknowledged (after their
    disk writes), the rest of a pipelined burst is not read, and the connection ends with
    a clean EOF (no RST that could destroy the acknowledgements in flight)."""
    proc = spawn_server("--disk", str(tmp_path / "data"), "--fsync", "always")
    keys = [f"late{i}" for i in range(200)]
    with Wire(proc.host, proc.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT_ACK, k, value(k, 64 * KiB)) for k in keys))
        proc.proc.send_signal(15)
        acked = 0
        while True:
            try:
                reply, _ = w.reply()
            except ConnectionError as exc:
                assert not isinstance(exc, ConnectionResetError)
                break
            assert reply.status == 200
            acked += 1
    assert acked >= 1
    assert proc.proc.wait(20) == 0
    proc.stop()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert get_many(w, keys[:acked]) == [value(k, 64 * KiB) for k in keys[:acked]]


def test_full_filesystem_evicts_and_keeps_accepting(small_fs: Path, spawn_server) -> None:
    """--disk-limit above what the filesystem holds: ENOSPC lowers the tier's effective
    capacity and evicts older objects, so every PUT_ACK succeeds; STATS shows both
    capacities, and the effective one rises again when space comes back."""
    ballast = small_fs / "ballast"
    ballast.write_bytes(bytes(4 * MiB))  # another user of the same 16 MiB filesystem
    proc = spawn_server("--disk", str(small_fs / "data"), "--disk-limit", "64MiB", "--memory-limit", "1MiB")
    keys = [f"full{i}" for i in range(120)]  # 30 MiB through less than 12 MiB of free space
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            reply, text = w.call(Command.PUT_ACK, key, value(key, 256 * KiB))
            assert reply.status == 200, (key, text)
        tier = disk_tier(stats(w))
        assert tier["capacity"] == 64 * MiB
        lowered = tier["effective_capacity"]
        assert 0 < lowered < 12 * MiB
        assert tier["bytes"] <= lowered and tier["evictions"] > 0 and tier["out_of_space"] > 0
        assert tier["write_errors"] == 0
        assert get_many(w, keys[-6:]) == [value(k, 256 * KiB) for k in keys[-6:]]  # from disk
        ballast.unlink()  # space comes back
        deadline = time.monotonic() + 60
        more = 0
        while disk_tier(stats(w))["effective_capacity"] < lowered + 2 * MiB:
            assert time.monotonic() < deadline, "the effective capacity never rose again"
            w.put(f"more{more}", value(f"more{more}", 256 * KiB))
            more += 1
            time.sleep(0.05)
        for i in range(more, more + 20):  # and the room is used
            w.put(f"more{i}", value(f"more{i}", 256 * KiB))
        assert disk_tier(stats(w))["bytes"] > lowered + MiB
    assert proc.terminate() == 0  # with the filesystem full, across a restart
    proc.restart()
    last = f"more{more + 19}"
    with Wire(proc.host, proc.port) as w:
        assert w.get(last) == value(last, 256 * KiB)
        for key in keys:
            w.put(key, value(key, 256 * KiB))
        assert get_many(w, keys[-6:]) == [value(k, 256 * KiB) for k in keys[-6:]]
        assert disk_tier(stats(w))["effective_capacity"] < 16 * MiB
