"""The bench drivers' bulk reply checks: a pipelined burst is counted, and a reply that is not
what a one-key EXIST(S) answers stops the run instead of being miscounted."""

from __future__ import annotations

import importlib.util
import socket
import sys
from pathlib import Path

import pytest

from lmproto import Generation, Status, encode_reply

# tests/bench shadows the repository's bench package on the test path: load the module by file.
_SPEC = importlib.util.spec_from_file_location(
    "lmbench_drivers", Path(__file__).parents[2] / "bench" / "drivers.py"
)
assert _SPEC is not None and _SPEC.loader is not None
drivers = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = drivers  # dataclasses look their module up
_SPEC.loader.exec_module(drivers)
LmDriver, TargetSpec, _exists_hits = drivers.LmDriver, drivers.TargetSpec, drivers._exists_hits


def test_redis_exists_replies_are_counted_in_bulk() -> None:
    assert _exists_hits(memoryview(b":1\r\n:0\r\n:1\r\n"), 3) == 2


@pytest.mark.parametrize("replies", [b":1\r\n:2\r\n", b":1\r\n-ERR\r\n"[:8], b"+OK\r\n:1\r"])
def test_redis_exists_replies_of_another_shape_stop_the_run(replies: bytes) -> None:
    with pytest.raises(ConnectionError):
        _exists_hits(memoryview(replies), 2)


@pytest.mark.parametrize("generation", list(Generation))
def test_lm_exist_replies_are_read_in_bulk(generation: Generation) -> None:
    hit = encode_reply(Status.SUCCESS, generation=generation)
    miss = encode_reply(Status.FAIL, generation=generation)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        driver = LmDriver(TargetSpec(kind="lm", host="127.0.0.1", port=port, generation=int(generation)))
        peer, _ = listener.accept()
        with driver.sock, peer:
            driver.exist_hdr = [b""] * 3000  # nothing to send: the replies are already queued
            peer.sendall((hit + miss + hit) * 1000)  # more than one staging buffer's worth
            assert driver.exist(list(range(3000))) == 2000
            peer.sendall(hit + encode_reply(Status.SUCCESS, 5, generation=generation) + b"12345")
            with pytest.raises(ConnectionError):
                driver.exist([0, 1])
