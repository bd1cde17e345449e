"""A fleet as an operator runs one: three lmserver hosts and a client host, each a network
namespace this test creates (and always removes), servers on private addresses, one shared
tier (an S3 bucket through the NIXL OBJ tier, and an HF bucket through the fake Hub). The
client (lmclient, several servers) keeps reading while a server is killed and replaced, while
a host's link is down and back, and after a fourth server joins. Every byte read is checked;
every miss is counted, and only keys of the server that is away may miss."""

from __future__ import annotations

import hashlib
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import netfleet
import pytest
from netfleet.fleet import Fleet, Kind

from lmclient import Client, Retry, Timeout

KiB = 1024
KEYS = [f"fleet@1@0@{i:016x}@bfloat16" for i in range(120)]
CALL = Timeout(1.0, connect=0.5)  # one call's deadline: what a host that is away costs
RETRY = Retry(retries=2, base=0.02, cap=0.1)
RECOVERY_S = 30.0  # detects a hang only


def value(key: str) -> bytes:
    seed = hashlib.sha256(key.encode()).digest()
    return seed * (64 * KiB // 32)


@pytest.fixture(params=["s3", "hf"])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    why = netfleet.unavailable()
    if why is not None:
        pytest.skip(why)
    kind: Kind = request.param
    pytest.importorskip("nixl_cu12" if kind == "s3" else "huggingface_hub")
    with Fleet(tmp_path, kind, hosts=4) as made:
        yield made


class Reader:
    """The client's view: every GET checked; misses and wrong bytes kept per phase."""

    def __init__(self, servers: list[str]) -> None:
        self.client = Client(servers=servers, timeout=CALL, retry=RETRY)

    def read_all(self) -> tuple[set[str], set[str]]:
        missed, wrong = set(), set()
        for key in KEYS:
            got = self.client.get(key)
            if got is None:
                missed.add(key)
            elif got != value(key):
                wrong.add(key)
        return missed, wrong

    def wait_served(self, key: str) -> int:
        """GET ``key`` until it is served again; returns the misses meanwhile."""
        misses = 0
        deadline = time.monotonic() + RECOVERY_S
        while (got := self.client.get(key)) is None:
            misses += 1
            assert time.monotonic() < deadline, f"{key} was never served again"
            time.sleep(0.02)
        assert got == value(key)
        return misses


def test_a_fleet_survives_a_replaced_server_a_cut_link_and_a_new_server(fleet: Fleet) -> None:
    fleet.start("h1", "h2", "h3")
    three = [fleet.address(h) for h in ("h1", "h2", "h3")]
    reader: Reader = fleet.on_client(Reader, three)
    c = reader.client
    # Each PUT_ACK is answered once its object is in the shared tier (the first behind
    # memory): a bucket commit, more than the reader's one-second calls allow for 120.
    writer = fleet.on_client(Client, servers=three, timeout=Timeout(60))
    fleet.on_client(writer.put_many, KEYS, [value(k) for k in KEYS], ack=True)
    fleet.on_client(writer.close)
    owner = {key: c.server_for(key) for key in KEYS}
    share = Counter(owner.values())
    assert set(share) == set(three) and min(share.values()) >= 20, share

    # A server dies: only its keys miss; a fresh server in its place serves them from the
    # shared tier at once (it listed the tier before it began to listen).
    fleet.kill("h2")
    missed, wrong = fleet.on_client(reader.read_all)
    assert missed == {k for k in KEYS if owner[k] == fleet.address("h2")} and not wrong
    fleet.restart("h2")
    first = min(missed)
    fleet.on_client(reader.wait_served, first)  # the client tries it again after its backoff
    assert fleet.on_client(reader.read_all) == (set(), set())

    # A host's link goes down: its keys miss, costing one call's deadline per skip period;
    # the others answer as before. Once the link is back, the host is used again.
    fleet.net.link(fleet.host("h3"), up=False)
    down_before = c.counters["server_down"]
    started = time.monotonic()
    missed, wrong = fleet.on_client(reader.read_all)
    elapsed = time.monotonic() - started
    assert missed == {k for k in KEYS if owner[k] == fleet.address("h3")} and not wrong
    failed_tries = c.counters["server_down"] - down_before
    assert failed_tries >= 1 and elapsed < failed_tries * CALL.total + 5.0
    fleet.net.link(fleet.host("h3"), up=True)
    fleet.on_client(reader.wait_served, min(missed))
    assert fleet.on_client(reader.read_all) == (set(), set())

    # A fourth server joins: about a quarter of the keys move, all of them to it, and it
    # serves them from the shared tier; every key is still served.
    fleet.start("h4")
    four = [*three, fleet.address("h4")]
    bigger: Reader = fleet.on_client(Reader, four)
    moved = {k for k in KEYS if bigger.client.server_for(k) != owner[k]}
    assert all(bigger.client.server_for(k) == fleet.address("h4") for k in moved)
    assert 0.15 * len(KEYS) <= len(moved) <= 0.35 * len(KEYS), len(moved)
    assert fleet.on_client(bigger.read_all) == (set(), set())
    h4 = fleet.on_client(bigger.client.stats)[fleet.address("h4")]
    assert h4["tiers"][-1]["hits"] == len(moved)  # every moved key came from the shared tier
    fleet.on_client(reader.client.close)
    fleet.on_client(bigger.client.close)
