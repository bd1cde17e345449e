"""GET and EXIST through real servers on one shared tier (an S3 bucket through NIXL OBJ, and an
HF bucket through the fake Hub), as protocol/SPEC.md states them: a GET finds what another
server wrote before this one's next refresh (``probe``, the default on a shared tier), EXIST
answers from the index only, a GET of a key that is nowhere costs one probe, and a backend
that fails stops being probed for a while."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fakehub import TOKEN, FakeHub
from fakehub.fixtures import BUCKET
from wire import Wire

from lmproto import Command, Generation, ObjectMeta, decode_json

MiB = 1024 * 1024
META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)
NEVER = "3600"  # a refresh period no test waits for


@pytest.fixture(params=["s3", "hf"])
def shared_spec(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Makes the --tier spec of one shared tier (the same backend for every call)."""
    if request.param == "s3":
        pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
        from tiers.nixl_support import S3Server, obj_spec

        server = S3Server()
        bucket = server.bucket()
        yield lambda **options: obj_spec(
            server, bucket, capacity="64MiB", shared="true", mode="write-behind", **options
        )
        server.stop()
    else:
        pytest.importorskip("huggingface_hub")
        with FakeHub(tmp_path / "hub") as hub:
            hub.create(BUCKET)
            base = f"hf://buckets/{BUCKET}/kv?endpoint={hub.endpoint}&token={TOKEN}&mode=write-behind&window=0.01"
            yield lambda **options: base + "".join(f"&{k}={v}" for k, v in options.items())


def tier_stats(w: Wire) -> dict:
    reply, body = w.call(Command.STATS)
    assert reply.status == 200
    return decode_json(body)["tiers"][-1]


def exists(w: Wire, key: str) -> bool:
    reply, _ = w.call(Command.EXIST, key)
    return reply.status == 200


def test_a_get_finds_what_another_server_wrote_before_its_refresh(shared_spec, make_server_thread) -> None:
    a = make_server_thread(memory_limit=64 * MiB, tiers=(shared_spec(refresh=NEVER),))
    c = make_server_thread(memory_limit=64 * MiB, tiers=(shared_spec(refresh=NEVER),))
    value = bytes(range(256)) * 4096
    with Wire(a.host, a.port, Generation.V1) as wa, Wire(c.host, c.port, Generation.V1) as wc:
        reply, _ = wa.call(Command.PUT_ACK, "written-on-a", value, META)  # answered once in the bucket
        assert reply.status == 200
        assert not exists(wc, "written-on-a")  # EXIST: c's index, not refreshed yet
        reply, body = wc.call(Command.GET, "written-on-a")
        assert reply.status == 200 and body == value and reply.meta == META
        assert exists(wc, "written-on-a")  # the probe indexed it (and it is in memory now)
        stats = tier_stats(wc)
        assert stats["probes"] == 1 and stats["probe_hits"] == 1 and stats["hits"] == 1

        reply, _ = wc.call(Command.GET, "written-nowhere")  # a miss costs one probe
        assert reply.status == 400
        stats = tier_stats(wc)
        assert stats["probes"] == 2 and stats["probe_hits"] == 1 and stats["probes_skipped"] == 0


def test_probe_false_leaves_a_get_to_the_index(shared_spec, make_server_thread) -> None:
    a = make_server_thread(memory_limit=64 * MiB, tiers=(shared_spec(refresh=NEVER),))
    c = make_server_thread(memory_limit=64 * MiB, tiers=(shared_spec(refresh=NEVER, probe="false"),))
    with Wire(a.host, a.port, Generation.V1) as wa, Wire(c.host, c.port, Generation.V1) as wc:
        reply, _ = wa.call(Command.PUT_ACK, "written-on-a", b"x" * 1000, META)
        assert reply.status == 200
        reply, _ = wc.call(Command.GET, "written-on-a")
        assert reply.status == 400
        assert tier_stats(wc)["probes"] == 0


def test_a_backend_that_fails_is_not_probed_for_a_while(make_server_thread, tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")
    with socket.socket() as closed:  # a port nothing listens on: every request is refused
        closed.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{closed.getsockname()[1]}"
    spec = (
        f"nixl:s3://gone/kv?endpoint={endpoint}&access_key=test&secret_key=test"
        f"&timeout=5&capacity=1MiB&shared=true&refresh={NEVER}"
    )
    server = make_server_thread(memory_limit=64 * MiB, tiers=(spec,))
    with Wire(server.host, server.port, Generation.V1) as w:
        for n in range(6):
            reply, _ = w.call(Command.GET, f"k{n}")
            assert reply.status == 400
        stats = tier_stats(w)
        # The first GET's probe failed; the gate then answers the next ones as misses at once.
        assert stats["probes"] == 1 and stats["probes_skipped"] == 5 and stats["errors"] >= 1


def test_a_hub_that_fails_is_not_probed_for_a_while(make_server_thread, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("huggingface_hub")
    from fakehub.fixtures import skip_backoff_sleeps

    skip_backoff_sleeps(monkeypatch)  # huggingface_hub's own retries would take ~23 s
    with FakeHub(tmp_path / "hub") as hub:
        hub.create(BUCKET)
        spec = f"hf://buckets/{BUCKET}/kv?endpoint={hub.endpoint}&token={TOKEN}&refresh={NEVER}"
        server = make_server_thread(memory_limit=64 * MiB, tiers=(spec,))
        hub.stop()
        with Wire(server.host, server.port, Generation.V1) as w:
            for n in range(6):
                reply, _ = w.call(Command.GET, f"k{n}")
                assert reply.status == 400
            stats = tier_stats(w)
            # The first GET's probe failed: the tier is unhealthy and asks the Hub nothing more.
            assert stats["probes"] == 1 and stats["healthy"] is False and stats["misses"] == 6
        hub.start()
