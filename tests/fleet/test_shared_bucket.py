"""Three lmserver processes on one Hugging Face bucket at once (the fake Hub serves its storage
over HTTP, as the real Hub does): each writes its own objects while reading the others', every
server serves every object, and a server replaced by a fresh process is warm from the bucket."""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from pathlib import Path

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import TOKEN, FakeHub
from fakehub.fixtures import BUCKET
from wire import Wire

from lmproto import Command, Generation, ObjectMeta, decode_json

KiB = 1024
META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)
PER_SERVER = 8


def value(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * 8192)[: 192 * KiB + len(key)]  # distinct lengths and bytes per key


def hf_stats(w: Wire) -> dict:
    reply, body = w.call(Command.STATS)
    assert reply.status == 200
    return next(t for t in decode_json(body)["tiers"] if t["name"] == "hf")


def write_and_read_the_next(server, me: int) -> list[str]:
    """PUT_ACK this server's keys (answered once each is in the bucket); after each, GET from
    this server the key the next writer wrote at the same step, once it exists."""
    read: list[str] = []
    with Wire(server.host, server.port, Generation.V1) as w:
        for n in range(PER_SERVER):
            key = f"s{me}-{n}"
            reply, _ = w.call(Command.PUT_ACK, key, value(key), META)
            assert reply.status == 200, reply
            other = f"s{(me + 1) % 3}-{n}"
            deadline = time.monotonic() + 60  # detects a hang only: the other writer's pace
            while (got := w.get(other)) is None:
                assert time.monotonic() < deadline, f"{other} never became readable"
                time.sleep(0.01)
            assert got == value(other)
            read.append(other)
    return read


def test_three_servers_share_one_bucket_and_a_replaced_one_is_warm(spawn_server, tmp_path: Path) -> None:
    with FakeHub(tmp_path / "hub") as hub:
        hub.create(BUCKET)
        spec = (
            f"hf://buckets/{BUCKET}/fleet?endpoint={hub.endpoint}&token={TOKEN}"
            "&mode=write-behind&window=0.01&refresh=30"
        )
        servers = [spawn_server("--tier", spec, "--memory-limit", "64MiB") for _ in range(3)]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            done = list(pool.map(write_and_read_the_next, servers, range(3)))
        assert all(len(read) == PER_SERVER for read in done)
        keys = [f"s{me}-{n}" for me in range(3) for n in range(PER_SERVER)]
        assert len(hub.files(BUCKET)) == len(keys)
        for server in servers:  # every server serves every object, whoever wrote it
            with Wire(server.host, server.port, Generation.V1) as w:
                assert all(w.get(key) == value(key) for key in keys)

        replaced = servers[0]
        replaced.kill()  # SIGKILL: its memory is gone
        replaced.restart()  # a fresh process on the same port: it lists the bucket at start
        with Wire(replaced.host, replaced.port, Generation.V1) as w:
            before = hf_stats(w)
            assert before["objects"] == len(keys)  # listed before it began to listen
            for key in keys:
                reply, body = w.call(Command.GET, key)
                assert reply.status == 200 and body == value(key) and reply.meta == META
            after = hf_stats(w)
            assert after["hits"] - before["hits"] == len(keys)  # each served from the bucket
            assert after["probes"] == 0  # the listing knew them all: nothing to look for
        assert hub.cas.rejected_tokens == 0
