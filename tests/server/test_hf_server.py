"""The HF Buckets tier in real servers on loopback: two lmserver instances on one bucket
(through the fake Hub), one serves what the other wrote; STATS reports the tier's health."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import TOKEN, FakeHub
from fakehub.fixtures import BUCKET, skip_backoff_sleeps
from startup import startup_error
from wire import Wire

from lmproto import Command, Generation, ObjectMeta, decode_json

MiB = 1024 * 1024
META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)


@pytest.fixture
def fake_hub(tmp_path: Path) -> Iterator[FakeHub]:
    hub = FakeHub(tmp_path / "hub").start()
    hub.create(BUCKET)
    yield hub
    hub.stop()


def hf_stats(w: Wire) -> dict:
    reply, body = w.call(Command.STATS)
    assert reply.status == 200
    return next(t for t in decode_json(body)["tiers"] if t["name"] == "hf")


def wait_for(check, what: str, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_two_servers_share_one_bucket(fake_hub: FakeHub, make_server_thread, monkeypatch) -> None:
    # (fake_hub first: it is set up first and torn down last, after the servers)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    spec = f"hf://buckets/{BUCKET}/srv?endpoint={fake_hub.endpoint}&mode=write-behind&refresh=0.2&window=0.01"
    writer = make_server_thread(memory_limit=64 * MiB, tiers=(spec,))
    reader = make_server_thread(memory_limit=64 * MiB, tiers=(spec,))
    value = bytes(range(256)) * 4096  # 1 MiB
    with (
        Wire(writer.host, writer.port, Generation.V1) as w,
        Wire(reader.host, reader.port, Generation.V1) as r,
    ):
        w.put("shared-key", value, META)
        wait_for(lambda: hf_stats(w)["objects"] == 1, "the write-behind to the bucket")
        stats = hf_stats(w)
        assert stats["is_healthy"] is True and stats["pending"] == 0 and stats["failures"] == 0
        assert stats["bytes"] == sum(f.size for f in fake_hub.files(BUCKET).values())
        assert stats["capacity"] == 0 and stats["complete_index"] is False

        def reader_sees() -> bool:
            reply, _ = r.call(Command.EXIST, "shared-key")
            return reply.status == 200

        wait_for(reader_sees, "the reader's refresh")
        reply, body = r.call(Command.GET, "shared-key")
        assert reply.status == 200 and body == value
        assert hf_stats(r)["hits"] == 1


def test_the_hub_going_away_leaves_the_server_serving(
    fake_hub: FakeHub, make_server_thread, monkeypatch
) -> None:
    skip_backoff_sleeps(monkeypatch)  # huggingface_hub's retries would take ~23 s per call
    spec = (
        f"hf://buckets/{BUCKET}/srv?endpoint={fake_hub.endpoint}&token={TOKEN}"
        "&mode=write-behind&refresh=0.2&window=0.01"
    )
    server = make_server_thread(memory_limit=64 * MiB, tiers=(spec,))
    with Wire(server.host, server.port, Generation.V1) as w:
        fake_hub.stop()
        for i in range(5):
            w.send(Command.PUT, f"k{i}", b"v" * 1000, META)  # fire and forget
        wait_for(lambda: hf_stats(w)["is_healthy"] is False, "unhealthy in STATS")
        for i in range(5):  # memory still serves everything
            reply, body = w.call(Command.GET, f"k{i}")
            assert reply.status == 200 and body == b"v" * 1000
        stats = hf_stats(w)
        assert stats["failures"] >= 1 and stats["objects"] == 0
        fake_hub.start()
        wait_for(lambda: hf_stats(w)["is_healthy"] is True, "healthy again")


def test_a_write_behind_bucket_keeps_a_burst_larger_than_memory(
    fake_hub: FakeHub, make_server_thread, monkeypatch
) -> None:
    """40 plain PUTs of 1 MiB through 32 MiB of memory into a write-behind bucket (full=wait,
    the default with that mode): the connection waits for the bucket instead of anything
    being skipped or dropped; a fresh server serves all 40 from the bucket."""
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    spec = f"hf://buckets/{BUCKET}/burst?endpoint={fake_hub.endpoint}&mode=write-behind&window=0.01"
    server = make_server_thread(memory_limit=32 * MiB, tiers=(spec,), memory_wait=60.0)
    keys = [f"burst{i}" for i in range(40)]
    body = bytes(range(256)) * 4096  # 1 MiB
    with Wire(server.host, server.port, Generation.V1) as w:
        w.send_raw(b"".join(w.frame(Command.PUT, k, body, META) for k in keys))
        reply, got = w.call(Command.GET, keys[-1])
        assert reply.status == 200 and got == body
        wait_for(lambda: hf_stats(w)["objects"] == len(keys), "every object in the bucket", 120)
        reply, raw = w.call(Command.STATS)
        st = decode_json(raw)
        assert st["tiers"][0]["demotions_dropped"] == 0 and hf_stats(w)["skipped_writes"] == 0
    fresh = make_server_thread(memory_limit=32 * MiB, tiers=(spec,))
    with Wire(fresh.host, fresh.port, Generation.V1) as w:
        for key in keys:
            reply, got = w.call(Command.GET, key)
            assert reply.status == 200 and got == body, key


@pytest.mark.parametrize(
    ("bucket", "token", "said"),
    [("lmtest/missing", TOKEN, "not found"), (BUCKET, "hf_refused_token", "refused the token")],
)
def test_a_bucket_that_cannot_be_used_is_a_startup_error(
    fake_hub: FakeHub, bucket: str, token: str, said: str
) -> None:
    """It printed a ~40-line traceback and exited 1."""
    spec = f"hf://buckets/{bucket}/srv?endpoint={fake_hub.endpoint}&token={token}"
    error = startup_error("--tier", spec)
    assert error.startswith("--tier hf://buckets/") and said in error and token not in error


def test_a_hub_refusing_connections_turns_the_tier_unhealthy_at_once(fake_hub: FakeHub, spawn_server) -> None:
    """huggingface_hub retries a refused connection for ~23 s (its real backoff, not skipped
    here): STATS said healthy all that time while writes piled up."""
    spec = (
        f"hf://buckets/{BUCKET}/srv?endpoint={fake_hub.endpoint}&token={TOKEN}"
        "&mode=write-behind&refresh=0.2&window=0.01"
    )
    server = spawn_server("--tier", spec)
    with Wire(server.host, server.port, Generation.V1) as w:
        w.put("before", b"v" * 1000, META)
        wait_for(lambda: hf_stats(w)["objects"] == 1, "the write behind")
        fake_hub.stop()
        started = time.monotonic()
        for i in range(5):
            w.send(Command.PUT, f"k{i}", b"v" * 1000, META)
        wait_for(lambda: hf_stats(w)["is_healthy"] is False, "unhealthy in STATS", deadline_s=60)
        assert time.monotonic() - started < 5  # one failed attempt, not the retries' ~23 s
        # A PUT_ACK the tier refuses says which tier refused, not "not on disk".
        reply, reason = w.call(Command.PUT_ACK, "after", b"a" * 100, META)
        assert reply.status == 507 and reason == b"stored in memory, not in tier hf"
        fake_hub.start()
