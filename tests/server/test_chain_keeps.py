"""The chain keeps what it accepts: a burst that outruns memory reaches the disk whole (a
restart finds all of it), a tier that falls behind either makes the PUT's connection wait
(``full=wait``: nothing skipped, other connections never wait) or skips with a stated
reason (``full=skip``), and memory evicts what a tier already holds before what it does not.
Real servers (threads and subprocesses) on loopback, real files."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaintiers import DictTier
from disktier import allocated
from structlog.testing import capture_logs
from wire import Wire

from lmproto import Command, Generation, ObjectMeta, decode_json, decode_key_lines
from lmserver.storage.memory import MemoryTier, MemoryVictim
from lmserver.storage.tiers import registry

KiB = 1024
MiB = 1024 * KiB


def value(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def stats(w: Wire) -> dict:
    return decode_json(w.call(Command.STATS)[1])


def tier(st: dict, name: str) -> dict:
    return next(t for t in st["tiers"] if t["name"] == name)


def wait_for(w: Wire, done, what: str, timeout: float = 60) -> dict:
    """Poll STATS until ``done(stats)`` (the server's own progress, not a sleep that hopes)."""
    deadline = time.monotonic() + timeout
    while True:
        st = stats(w)
        if done(st):
            return st
        assert time.monotonic() < deadline, f"{what}: {st}"
        time.sleep(0.01)


@pytest.fixture(autouse=True)
def dict_kind() -> Iterator[None]:
    registry.register("dict", DictTier.from_spec)
    yield
    registry.unregister("dict")
    for gate in DictTier.gates.values():
        gate.set()
    DictTier.gates.clear()
    DictTier.instances.clear()


# -- the headline: --disk means a warm restart --------------------------------------------------


def test_a_burst_through_small_memory_survives_a_clean_restart(spawn_server, tmp_path: Path) -> None:
    """2,000 plain PUTs of 64 KiB (125 MiB) through 32 MiB of memory at default settings, then
    SIGTERM as soon as the server has read them: the restart serves every one, byte for byte."""
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data), "--memory-limit", "32MiB")
    keys = [f"burst/{i:04d}" for i in range(2000)]
    with Wire(proc.host, proc.port) as w:
        for start in range(0, len(keys), 100):
            w.send_raw(
                b"".join(w.frame(Command.PUT, k, value(k, 64 * KiB)) for k in keys[start : start + 100])
            )
        assert w.get(keys[-1]) == value(keys[-1], 64 * KiB)  # every PUT before it was read
        st = stats(w)
        disk = tier(st, "disk")
        assert disk["skipped_writes"] == 0, disk
        assert tier(st, "memory")["demotions_dropped"] == 0
    assert proc.terminate() == 0
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert decode_key_lines(w.call(Command.LIST, "burst/")[1]) == keys
        for key in keys:
            assert w.get(key) == value(key, 64 * KiB), key


def test_objects_on_disk_before_a_sigkill_survive_it(spawn_server, tmp_path: Path) -> None:
    """500 plain PUTs, written to the disk (STATS says so), then SIGKILL: no clean stop, no
    index commit waited for; the restart finds every one above the segment's watermark."""
    data = tmp_path / "data"
    proc = spawn_server("--disk", str(data), "--memory-limit", "32MiB")
    keys = [f"kill/{i:03d}" for i in range(500)]
    with Wire(proc.host, proc.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, k, value(k, 64 * KiB)) for k in keys))
        assert w.get(keys[-1]) == value(keys[-1], 64 * KiB)
        wait_for(w, lambda st: tier(st, "disk")["objects"] == 500, "every object written to the disk")
    proc.kill()
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        assert decode_key_lines(w.call(Command.LIST, "kill/")[1]) == keys
        for key in keys:
            assert w.get(key) == value(key, 64 * KiB), key
        assert tier(stats(w), "disk")["bytes"] == allocated(data)


# -- full=wait and full=skip --------------------------------------------------------------------


def test_full_wait_skips_nothing_and_other_connections_never_wait(make_server_thread) -> None:
    """A tier that takes no write until its gate opens, with a 1 MiB queue and full=wait: the
    PUT stream's connection stops reading bodies once the queue is full, while another
    connection's GETs and EXISTs are all answered; opening the gate lets every write through."""
    gated = "dict:?gated=true&mode=write-behind&queue=1MiB&full=wait"
    server = make_server_thread(memory_limit=64 * MiB, tiers=(gated,), memory_wait=120.0)
    keys = [f"w{i}" for i in range(64)]  # 4 MiB: four times the queue
    with Wire(server.host, server.port) as reader:
        reader.send(Command.PUT, "there", value("there", 64 * KiB))
        writer = Wire(server.host, server.port)
        try:
            sender = threading.Thread(
                target=writer.send_raw,
                args=(b"".join(writer.frame(Command.PUT, k, value(k, 64 * KiB)) for k in keys),),
            )
            sender.start()
            wait_for(reader, lambda st: tier(st, "dict")["full_waits"] > 0, "the writer waits for room")
            for _ in range(50):  # answered while the writer is held back
                assert reader.get("there") == value("there", 64 * KiB)
                assert reader.call(Command.EXIST, "there")[0].status == 200
            held_back = stats(reader)
            assert tier(held_back, "dict")["queue_bytes"] <= 1 * MiB + 64 * KiB
            assert held_back["tiers"][0]["objects"] < len(keys)  # not all bodies read yet
            DictTier.gates["dict"].set()
            sender.join(60)
            assert writer.get(keys[-1]) == value(keys[-1], 64 * KiB)
            done = wait_for(reader, lambda st: tier(st, "dict")["objects"] == len(keys) + 1, "all written")
        finally:
            writer.close()
        dict_stats = tier(done, "dict")
        assert dict_stats["skipped_writes"] == 0 and dict_stats["full"] == "wait"


def test_full_wait_gives_up_after_memory_wait_and_says_why(make_server_thread) -> None:
    gated = "dict:?gated=true&mode=write-behind&queue=256KiB&full=wait"
    server = make_server_thread(memory_limit=64 * MiB, tiers=(gated,), memory_wait=0.1)
    with capture_logs() as logs, Wire(server.host, server.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, f"k{i}", value(f"k{i}", 64 * KiB)) for i in range(12)))
        assert w.get("k11") == value("k11", 64 * KiB)  # stored in memory all the same
        dict_stats = tier(stats(w), "dict")
    DictTier.gates["dict"].set()  # the server stops with nothing left waiting
    assert dict_stats["skipped_wait_timeout"] > 0
    assert dict_stats["skipped_writes"] == dict_stats["skipped_wait_timeout"]
    skipped = [e for e in logs if e["event"] == "tier write skipped"]
    assert skipped and "waited --memory-wait" in skipped[0]["reason"]


def test_full_skip_counts_each_bound_it_hit(make_server_thread) -> None:
    """full=skip: past the tier's queue the write is skipped (skipped_queue_full); past the
    memory share for objects waiting for tiers (--dirty-limit), likewise (skipped_dirty_full);
    the log names the bound. Nobody waits."""
    queue_bound = "dict:?gated=true&mode=write-behind&queue=256KiB&full=skip&name=small"
    dirty_bound = "dict:?gated=true&mode=write-behind&full=skip&name=big"
    server = make_server_thread(memory_limit=64 * MiB, tiers=(queue_bound, dirty_bound), dirty_limit=1 * MiB)
    with capture_logs() as logs, Wire(server.host, server.port) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, f"k{i}", value(f"k{i}", 64 * KiB)) for i in range(40)))
        assert w.get("k39") == value("k39", 64 * KiB)
        st = stats(w)
    for gate in DictTier.gates.values():
        gate.set()  # the server stops with nothing left waiting
    small, big = tier(st, "small"), tier(st, "big")
    assert small["skipped_queue_full"] > 0 and big["skipped_dirty_full"] > 0
    assert small["full_waits"] == big["full_waits"] == 0
    assert st["store"]["chain"]["dirty_bytes"] <= 1 * MiB + 64 * KiB
    reasons = {e["reason"] for e in logs if e["event"] == "tier write skipped"}
    assert {"the tier's queue is full", "--dirty-limit reached"} <= reasons


def test_the_full_policy_follows_the_mode_by_default(make_server_thread, tmp_path: Path) -> None:
    """write-behind tiers are to hold everything: they wait; demote-only tiers skip."""
    tiers = ("dict:?mode=write-behind&name=wb", "dict:?name=cold", "dict:?mode=write-behind&full=skip&name=x")
    server = make_server_thread(disk=tmp_path / "d", tiers=tiers)
    with Wire(server.host, server.port, Generation.V1) as w:
        st = stats(w)
    assert [tier(st, name)["full"] for name in ("disk", "wb", "cold", "x")] == [
        "wait",
        "wait",
        "skip",
        "skip",
    ]


# -- clean before dirty -----------------------------------------------------------------------


def commit(memory: MemoryTier, key: str, size: int = 4 * KiB, *, clean: bool) -> None:
    entry = memory.reserve(size)
    assert entry is not None
    memory.commit(key, entry, ObjectMeta())
    if clean:
        memory.mark_clean(entry)


def test_memory_evicts_what_a_tier_holds_before_what_it_does_not() -> None:
    memory = MemoryTier(10 * 4 * KiB + 10 * 1024, shards=4)
    memory.clean_first = True
    taken: list[MemoryVictim] = []
    memory.on_evict = taken.append
    memory.pool.set_lend_limit(4 * KiB)  # room to demote one object at a time
    for i in range(10):  # the oldest five dirty, the newest five clean
        commit(memory, f"k{i}", clean=i >= 5)

    def gone() -> list[int]:
        return [i for i in range(10) if not memory.contains(f"k{i}")]

    commit(memory, "new", clean=False)
    assert gone() and gone() == list(range(5, 5 + len(gone())))  # clean ones, oldest first
    assert taken == [] and memory.counters.demotions_dropped == 0  # dropped: a tier holds them
    while len(gone()) < 5:
        commit(memory, f"more{len(gone())}", clean=False)
    assert gone() == [5, 6, 7, 8, 9]  # every dirty one is still here
    commit(memory, "last", clean=False)  # no clean one left: the oldest dirty one is demoted
    assert not memory.contains("k0") and [v.key for v in taken] == ["k0"]
    for victim in taken:
        victim.release()


def test_a_dirty_object_that_cannot_be_demoted_waits_for_every_clean_one() -> None:
    """The lent share is full: rather a clean object from anywhere (even past the cold end
    eviction looks at) than dropping one no tier holds."""
    from lmserver.storage import memory as memory_module

    memory = MemoryTier(70 * 4 * KiB + 70 * 1024, shards=1)
    memory.clean_first = True
    memory.on_evict = lambda victim: pytest.fail("nothing may be demoted: the share is full")
    memory.pool.set_lend_limit(0)
    for i in range(memory_module.CLEAN_SCAN + 5):
        commit(memory, f"dirty{i}", clean=False)
    commit(memory, "clean", clean=True)  # far from the cold end
    while len(list(memory.keys())) < 70:
        commit(memory, f"fill{len(list(memory.keys()))}", clean=False)
    commit(memory, "new", clean=False)
    assert not memory.contains("clean") and memory.contains("dirty0")
    assert memory.counters.demotions_dropped == 0


def test_a_full_wait_tier_makes_memory_wait_rather_than_drop_a_dirty_object() -> None:
    """The first tier is full=wait and the share for objects on their way down is full: memory
    keeps its dirty objects and refuses the reservation (the PUT then waits for room)."""
    memory = MemoryTier(4 * 4 * KiB + 4 * 1024, shards=1)
    memory.clean_first, memory.drop_dirty = True, False
    memory.on_evict = lambda victim: pytest.fail("nothing may be demoted: the share is full")
    memory.pool.set_lend_limit(0)
    for i in range(4):
        commit(memory, f"dirty{i}", clean=False)
    assert memory.reserve(4 * KiB) is None
    assert all(memory.contains(f"dirty{i}") for i in range(4))
    assert memory.counters.demotions_waited == 1 and memory.counters.demotions_dropped == 0
