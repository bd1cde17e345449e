"""The tier chain through a real server on loopback: a slow tier never stalls the engine,
evicted objects are demoted down the chain and promoted back, DELETE and overwrite act on
every tier, and bad --tier specs are startup errors."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from chaintiers import DictTier
from wire import Wire

from lmproto import Command, Generation, ObjectMeta, decode_json
from lmserver.config import ServerConfig
from lmserver.server import Server
from lmserver.storage.tiers import registry
from lmserver.storage.tiers.base import ConfigError
from lmserver.storage.tiers.spec import TierSpec

KiB = 1024
MiB = 1024 * KiB
META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)


def value(key: str, size: int) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // 32 + 1))[:size]


def stats(w: Wire) -> dict:
    reply, body = w.call(Command.STATS)
    assert reply.status == 200
    return decode_json(body)


def tier_stats(w: Wire, name: str) -> dict:
    return next(t for t in stats(w)["tiers"] if t["name"] == name)


@pytest.fixture(autouse=True)
def dict_kind() -> Iterator[None]:
    registry.register("dict", DictTier.from_spec)
    yield
    registry.unregister("dict")
    for gate in DictTier.gates.values():
        gate.set()
    DictTier.gates.clear()
    DictTier.instances.clear()


def test_gets_on_a_put_stream_never_wait_for_a_stalled_tier(make_server_thread) -> None:
    # The only tier behind memory (full=skip) accepts no write until the gate opens: slower than
    # any disk. GETs interleaved with a PUT stream on one socket are all answered meanwhile.
    gated = "dict:?gated=true&mode=write-behind&queue=1MiB&full=skip"
    server = make_server_thread(memory_limit=64 * MiB, tiers=(gated,))
    keys = [f"k{i}" for i in range(200)]
    with Wire(server.host, server.port, Generation.V1) as w:
        burst = b""
        for i, key in enumerate(keys):
            burst += w.frame(Command.PUT, key, value(key, 64 * KiB))
            burst += w.frame(Command.GET, keys[i // 2])
        sender = threading.Thread(target=w.send_raw, args=(burst,))  # replies are read meanwhile
        sender.start()
        for i in range(len(keys)):
            reply, body = w.reply()
            assert (reply.status, body) == (200, value(keys[i // 2], 64 * KiB))
        sender.join()
        dict_stats = tier_stats(w, "dict")
        assert dict_stats["skipped_writes"] > 0  # the queue (1 MiB) filled: writes skipped
        assert dict_stats["queue_bytes"] <= 1 * MiB
        assert dict_stats["objects"] == 0  # nothing got through the gate yet
    DictTier.gates["dict"].set()


def test_disk_backlog_full_skips_writes_instead_of_stalling(make_server_thread, tmp_path: Path) -> None:
    # A disk whose write-behind queue holds nothing: every fire-and-forget write is skipped and
    # counted, the connection never stops, and PUT_ACK still reaches the disk.
    server = make_server_thread(disk=tmp_path / "d", write_behind_limit=0, memory_limit=64 * MiB)
    with Wire(server.host, server.port, Generation.V1) as w:
        for i in range(50):
            w.send(Command.PUT, f"f{i}", value(f"f{i}", 64 * KiB))
        assert w.get("f49") == value("f49", 64 * KiB)
        w.put("acked", value("acked", 64 * KiB))
        disk = tier_stats(w, "disk")
        assert disk["skipped_writes"] == 50
        assert disk["writes"] == 1
    store = server.server.state.store
    assert store.links[0].tier.contains("acked")
    assert not store.links[0].tier.contains("f49")


def settle(w: Wire) -> None:
    """Wait until no write is queued anywhere in the chain (demotions run in the background)."""
    deadline = time.monotonic() + 30
    while True:
        st = stats(w)
        busy = ("queue_depth", "held_bytes", "demoting_bytes")  # queued, or held for demotion
        if st["store"]["chain"]["victims_in_flight"] == 0 and not any(
            t.get(field) for t in st["tiers"] for field in busy
        ):
            return
        assert time.monotonic() < deadline, st
        time.sleep(0.005)


def put_settled(w: Wire, key: str, body: bytes, meta: ObjectMeta = META) -> None:
    w.put(key, body, meta)
    settle(w)


def test_a_clean_stop_writes_what_only_memory_holds(spawn_server, tmp_path: Path) -> None:
    # Every fire-and-forget disk write is skipped (a queue of 0 bytes): at SIGTERM the server
    # writes what only memory holds to the disk, so the restart serves all of it.
    proc = spawn_server("--disk", str(tmp_path / "d"), "--write-behind-limit", "0")
    keys = [f"m{i}" for i in range(50)]
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            w.send(Command.PUT, key, value(key, 64 * KiB))
        assert w.get(keys[-1]) == value(keys[-1], 64 * KiB)
        assert stats(w)["tiers"][1]["objects"] == 0
    assert proc.terminate() == 0
    assert proc.events("memory flushed to the first tier")[0]["objects"] == 50
    proc.restart()
    with Wire(proc.host, proc.port) as w:
        for key in keys:
            assert w.get(key) == value(key, 64 * KiB), key


def chain_server(make_server_thread, tmp_path: Path, disk_mode: str = "write-behind"):
    """memory (4 MiB) -> disk (8 MiB) -> dict (64 MiB)."""
    disk = f"disk:{tmp_path / 'd'}?capacity=8MiB&mode={disk_mode}"
    return make_server_thread(
        memory_limit=4 * MiB, max_object_size=512 * KiB, tiers=(disk, "dict:?capacity=64MiB")
    )


@pytest.mark.parametrize("disk_mode", ["write-behind", "demote"])
def test_evicted_objects_are_demoted_down_the_chain_and_promoted_back(
    make_server_thread, tmp_path, disk_mode: str
) -> None:
    server = chain_server(make_server_thread, tmp_path, disk_mode)
    keys = [f"obj{i}" for i in range(64)]  # 16 MiB through 4 MiB of memory and 8 MiB of disk
    with Wire(server.host, server.port, Generation.V1) as w:
        for key in keys:
            if disk_mode == "demote":  # fire-and-forget: reaches the disk only by demotion
                w.send(Command.PUT, key, value(key, 256 * KiB), META)
                settle(w)
            else:
                put_settled(w, key, value(key, 256 * KiB))
        dict_tier = DictTier.instances["dict"]
        assert dict_tier.index.bytes > 0  # the disk's victims went on to the third tier
        for key in keys:  # every object is somewhere, and comes back with its metadata
            reply, body = w.call(Command.GET, key)
            assert (reply.status, body) == (200, value(key, 256 * KiB)), key
            assert reply.meta == META
            settle(w)  # a promotion evicts, and demotes, in the background
        st = {t["name"]: t for t in stats(w)["tiers"]}
        if disk_mode == "demote":
            assert st["disk"]["demotions"] > 0  # memory -> disk
        else:
            assert st["disk"]["writes"] >= len(keys)  # every PUT_ACK
        assert st["dict"]["demotions"] > 0  # disk -> dict
        assert st["dict"]["promotions"] > 0  # dict -> memory
        assert st["disk"]["bytes"] <= 8 * MiB


def test_delete_removes_every_copy(make_server_thread, tmp_path) -> None:
    server = chain_server(make_server_thread, tmp_path)
    with Wire(server.host, server.port, Generation.V1) as w:
        put_settled(w, "victim", value("victim", 256 * KiB))
        for i in range(64):  # push it down to the last tier
            put_settled(w, f"filler{i}", value(f"f{i}", 256 * KiB))
        store = server.server.state.store
        assert DictTier.instances["dict"].contains("victim")
        assert w.call(Command.DELETE, "victim")[0].status == 200
        assert w.get("victim") is None
        assert not store.memory.contains("victim")
        assert not any(link.tier.contains("victim") for link in store.links)
        assert w.call(Command.EXIST, "victim")[0].status != 200
        assert w.call(Command.DELETE, "victim")[0].status == 404


def test_an_older_copy_below_never_shadows_a_newer_put(make_server_thread, tmp_path) -> None:
    server = chain_server(make_server_thread, tmp_path)
    with Wire(server.host, server.port, Generation.V1) as w:
        for version in range(4):
            put_settled(w, "hot", value(f"v{version}", 256 * KiB))
            for i in range(20 * version):  # evict "hot" from memory, then from disk too
                put_settled(w, f"fill{version}-{i}", value(f"f{i}", 256 * KiB))
            assert w.get("hot") == value(f"v{version}", 256 * KiB)
        # Fire-and-forget overwrites whose writes may be skipped: still never an older one.
        for version in range(4, 40):
            w.send(Command.PUT, "hot", value(f"v{version}", 256 * KiB))
            if version % 3 == 0:
                w.send(Command.PUT, f"push{version}", value("p", 256 * KiB))
        got = w.get("hot")
        assert got == value("v39", 256 * KiB)
        settle(w)  # the storm's writes are done (a tiny disk declines writes while it is full of them)
        for i in range(40):
            put_settled(w, f"late{i}", value(f"l{i}", 256 * KiB))
        assert w.get("hot") in (None, value("v39", 256 * KiB))


def test_list_and_exist_cover_every_tier(make_server_thread, tmp_path) -> None:
    server = chain_server(make_server_thread, tmp_path)
    keys = [f"list/{i:02d}" for i in range(64)]
    with Wire(server.host, server.port, Generation.V1) as w:
        for key in keys:
            put_settled(w, key, value(key, 256 * KiB))
        _, body = w.call(Command.LIST, "list/")
        assert body.decode().split("\n")[: len(keys)] == keys
        presence = w.call(Command.EXIST_MANY, "", b"".join(bytes([len(k)]) + k.encode() for k in keys))[1]
        assert presence == b"\x01" * len(keys)


def test_runs_of_exists_find_keys_on_every_tier(make_server_thread, tmp_path) -> None:
    """A run of EXISTs is answered from memory's dicts in one go, up to a key memory lacks:
    with tiers behind, that one is looked for further down, and the run goes on after it."""
    server = chain_server(make_server_thread, tmp_path)
    keys = [f"run/{i:02d}" for i in range(64)]  # 16 MiB: most of them below memory
    with Wire(server.host, server.port, Generation.V1) as w:
        for key in keys:
            put_settled(w, key, value(key, 256 * KiB))
        memory_keys = stats(w)["tiers"][0]["objects"]
        assert 0 < memory_keys < len(keys)
        asked = [k for key in keys for k in (key, f"{key}/absent")]
        assert w.call(Command.EXIST, keys[-1])[0].status == 200  # the run starts after an EXIST
        w.send_raw(b"".join(w.frame(Command.EXIST, key) for key in asked))
        assert [w.reply()[0].status for _ in asked] == [400 if k.endswith("absent") else 200 for k in asked]
        for key in asked[:16]:  # and one at a time
            assert w.call(Command.EXIST, key)[0].status == (400 if key.endswith("absent") else 200)


def test_stats_report_every_tier(make_server_thread, tmp_path) -> None:
    server = chain_server(make_server_thread, tmp_path)
    with Wire(server.host, server.port, Generation.V1) as w:
        tiers = stats(w)["tiers"]
    assert [t["name"] for t in tiers] == ["memory", "disk", "dict"]
    for tier in tiers[1:]:
        for field in ("objects", "bytes", "capacity", "hits", "misses", "evictions", "demotions"):
            assert field in tier, (tier["name"], field)
        for field in ("skipped_writes", "queue_depth", "queue_bytes", "mode", "healthy"):
            assert field in tier, (tier["name"], field)
    assert tiers[1]["mode"] == "write-behind"  # a disk takes every PUT unless told otherwise
    assert tiers[2]["mode"] == "demote"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nokind", "KIND:TARGET"),
        ("floppy:/a", "unknown tier kind"),
        ("disk:", "needs a directory"),
        ("disk:/x?capacity=lots", "capacity"),
        ("disk:/x?mode=sometimes", "mode"),
        ("disk:/x?colour=blue", "unknown option"),
        ("disk:/x?queue=1MiB&queue=2MiB", "given twice"),
    ],
)
def test_bad_tier_specs_are_startup_errors(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Server(ServerConfig(port=0, tiers=(spec,)))


def test_a_bad_tier_spec_is_a_clear_cli_error(spawn_server) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "lmserver", "--port", "0", "--tier", "floppy:/a", "--log-format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown tier kind" in out.stderr
    assert "Traceback" not in out.stderr


def test_tier_spec_parsing() -> None:
    spec = TierSpec.parse("hf://buckets/org/kv/prefix?capacity=1TiB&mode=write-behind")
    assert (spec.kind, spec.target) == ("hf", "//buckets/org/kv/prefix")
    assert spec.size("capacity", 0) == 1024**4
    assert spec.choice("mode", ("write-behind", "demote"), "demote") == "write-behind"
    spec.finish()
