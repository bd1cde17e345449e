"""NixlTier on the real nixl OBJ backend against a local S3 server (moto) started here."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from tiers.nixl_support import META, SIZES, S3Server, fetch, obj_spec, opened, payload, s3

from lmserver.storage.tiers import _diskfile, registry
from lmserver.storage.tiers.base import ConfigError
from lmserver.storage.tiers.spec import TierSpec

__all__ = ["s3"]  # the module-scoped S3 server fixture

KiB = 1024


def object_key(prefix: str, key: str) -> str:
    return f"{prefix}/objects/{_diskfile.object_name(key.encode())}"


async def test_round_trips(s3: S3Server) -> None:
    bucket = s3.bucket()
    async with opened(obj_spec(s3, bucket, capacity="256MiB")) as tier:
        for size in SIZES:
            assert await tier.put(f"k{size}", memoryview(payload(size, seed=size % 251)), META)
        for size in SIZES:
            got = await fetch(tier, f"k{size}")
            assert got is not None and got == (META, payload(size, seed=size % 251))
        u = tier.usage()
        assert (u.objects, u.counters["hits"], u.counters["puts"]) == (len(SIZES), len(SIZES), len(SIZES))
        # Every object is one S3 object: header + body.
        head = s3.s3.head_object(Bucket=bucket, Key=object_key("kv", "k4096"))
        assert head["ContentLength"] == _diskfile.header_size(b"k4096") + 4096


async def test_eviction_deletes_through_s3_and_restart_serves(s3: S3Server) -> None:
    bucket = s3.bucket()
    spec = obj_spec(s3, bucket, capacity="42KiB")
    async with opened(spec) as tier:
        for i in range(5):  # 10 KiB each + headers: the fifth evicts the first
            assert await tier.put(f"k{i}", memoryview(payload(10 * KiB, i)), META)
        assert not tier.contains("k0") and tier.usage().counters["evictions"] == 1
        listed = s3.s3.list_objects_v2(Bucket=bucket, Prefix="kv/objects/")["KeyCount"]
        assert listed == 4  # NIXL has no delete: the tier deleted k0 through boto3
        assert await tier.delete("k4")
    async with opened(spec) as tier:
        assert sorted(tier.keys()) == ["k1", "k2", "k3"]
        for i in (1, 2, 3):
            assert await fetch(tier, f"k{i}") == (META, payload(10 * KiB, i))


async def test_static_slots_in_a_bucket(s3: S3Server) -> None:
    bucket = s3.bucket()
    spec = obj_spec(s3, bucket, layout="static", slot_size="16KiB", slots=2)
    async with opened(spec) as tier:
        for i in range(3):
            assert await tier.put(f"k{i}", memoryview(payload(10 * KiB, i)), META)
        assert sorted(tier.keys()) == ["k1", "k2"] and tier.usage().counters["evictions"] == 1
        assert not await tier.put("big", memoryview(bytearray(16 * KiB)), META)
        assert tier.usage().counters["declined_too_large"] == 1
        keys = sorted(o["Key"] for o in s3.s3.list_objects_v2(Bucket=bucket)["Contents"])
        assert keys == ["kv/slots/00000000", "kv/slots/00000001"]
    async with opened(spec) as tier:
        assert sorted(tier.keys()) == ["k1", "k2"]
        assert await fetch(tier, "k2") == (META, payload(10 * KiB, 2))


async def test_corrupt_or_truncated_objects_are_counted_misses(s3: S3Server) -> None:
    bucket = s3.bucket()
    async with opened(obj_spec(s3, bucket, capacity="1MiB")) as tier:
        for key in ("flip", "cut", "gone", "ok"):
            assert await tier.put(key, memoryview(payload(8 * KiB)), META)
        raw = bytearray(s3.s3.get_object(Bucket=bucket, Key=object_key("kv", "flip"))["Body"].read())
        raw[-10] ^= 0xFF
        s3.s3.put_object(Bucket=bucket, Key=object_key("kv", "flip"), Body=bytes(raw))
        s3.s3.put_object(Bucket=bucket, Key=object_key("kv", "cut"), Body=bytes(raw[:1000]))
        s3.s3.delete_object(Bucket=bucket, Key=object_key("kv", "gone"))
        for key in ("flip", "cut", "gone"):
            assert await fetch(tier, key) is None
            assert not tier.contains(key)
        assert await fetch(tier, "ok") is not None
        c = tier.usage().counters
        assert c["corrupt"] + c["missing"] == 3 and c["corrupt"] >= 2 and c["misses"] == 3


async def test_two_servers_share_one_bucket(s3: S3Server) -> None:
    bucket = s3.bucket()
    spec_a = obj_spec(s3, bucket, capacity="1MiB", shared="true", refresh=0)
    spec_b = obj_spec(s3, bucket, capacity="1MiB", shared="true", refresh="0.2")
    async with opened(spec_a) as a:
        assert await a.put("before", memoryview(b"written before b started"), META)
        async with opened(spec_b) as b:
            assert b.contains("before") and not b.complete_index  # its open listed the bucket
            assert await a.put("k", memoryview(payload(5000)), META)
            assert await fetch(b, "k") == (META, payload(5000))  # a GET that misses probes
            assert await a.put("later", memoryview(b"x"), META)
            deadline = time.monotonic() + 60  # only detects a hang: refresh runs every 0.2 s
            while not b.contains("later"):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            assert await b.delete("later")  # deletes from the bucket, for both
            assert await fetch(a, "later") is None and a.usage().counters["missing"] == 1
            c = b.usage().counters
            assert c["probe_hits"] == 1 and c["refreshes"] >= 1 and c["refreshed_in"] >= 1


@pytest.fixture
def blackhole() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a hung S3 server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


async def test_a_dead_endpoint_fails_within_the_timeout(s3: S3Server, blackhole: str) -> None:
    bucket = s3.bucket()
    dead_spec = (
        f"nixl:s3://{bucket}/kv?endpoint={blackhole}&access_key=test&secret_key=test&timeout=1&capacity=1MiB"
    )
    async with opened(obj_spec(s3, bucket, capacity="1MiB")) as good:
        assert await good.put("k", memoryview(b"ok"), META)
        started = time.monotonic()
        async with opened(dead_spec) as dead:
            assert not dead.healthy and dead.usage().counters["errors"] >= 1
            put = asyncio.ensure_future(dead.put("x", memoryview(payload(100 * KiB)), META))
            # Other work goes on meanwhile, unaffected.
            for i in range(5):
                assert await fetch(good, "k") == (META, bytearray(b"ok"))
                assert await good.put(f"g{i}", memoryview(b"fine"), META)
            assert not await put
            c = dead.usage().counters
            assert c["timeouts"] == 1 and not dead.healthy and not dead.contains("x")
        # NIXL on its own gives up only after about 25 s; 1 s timeouts bound it far below.
        assert time.monotonic() - started < 20
        assert good.healthy


def silent_s3(s3: S3Server) -> tuple[socket.socket, str]:
    """A socket that accepts connections and answers only when the test does, and the spec
    of a tier (1 s timeout) that takes it for its S3 endpoint."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    spec = f"nixl:s3://{s3.bucket()}/kv?endpoint={endpoint}&access_key=test&secret_key=test&timeout=1&capacity=1MiB"
    return listener, spec


def read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    """An HTTP request's head, and what of its body came with it."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def answer_forbidden(listener: socket.socket) -> None:
    """Answer each request on ``listener`` with 403 (which the S3 SDK does not retry),
    until it is closed; requests whose sender gave up are answered too, into the void."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:  # closed: done
            return
        with conn, contextlib.suppress(OSError):
            conn.settimeout(2)  # a client that opened a connection and went quiet
            head, body = read_head(conn)
            if b"100-continue" not in head.lower():  # else the body is never sent
                length = re.search(rb"(?i)content-length:\s*(\d+)", head)
                while length and len(body) < int(length.group(1)) and (chunk := conn.recv(65536)):
                    body += chunk
            conn.sendall(b"HTTP/1.1 403 Forbidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")


async def test_a_transfer_given_up_at_its_deadline_is_released_only_once_it_ends(s3: S3Server) -> None:
    """A request given up at the deadline still runs in NIXL: its handle is kept until the
    request has ended, then released, and the agent and its buffer are torn down normally."""
    slow, spec = silent_s3(s3)
    answering = threading.Thread(target=answer_forbidden, args=(slow,), daemon=True)
    try:
        async with opened(spec) as tier:
            assert not await tier.put("x", memoryview(payload(100 * KiB)), META)
            assert tier.usage().counters["timeouts"] == 1
            lanes = list(tier._lanes)
            # The caller's deadline and the lane's are the same: let the lane finish first
            # (only an idle lane's agent may be asked from this thread).
            await until(lambda: all(lane.pending == 0 for lane in lanes))
            assert sum(lane.agent.unfinished for lane in lanes) == 1  # kept, not released
            answering.start()  # the request now ends
            await until(lambda: sum(lane.agent.unfinished for lane in lanes) == 0)
        # Nothing left running: each lane's agent and staging buffer were torn down.
        assert all(lane.staging.closed for lane in lanes)
    finally:
        with contextlib.suppress(OSError):
            slow.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress (Linux)
        slow.close()
        if answering.ident:
            answering.join()


def answer_puts_with_500(listener: socket.socket, needle: bytes, puts: int) -> int:
    """Answer requests on ``listener`` (500 to a PUT, which the S3 SDK retries, re-reading
    its body; 403 to anything else) until ``puts`` PUT bodies containing ``needle`` came."""
    seen = 0
    listener.settimeout(60)  # only detects a hang: the SDK retries within seconds
    while seen < puts:
        conn, _ = listener.accept()
        with conn, contextlib.suppress(OSError):
            conn.settimeout(30)  # only detects a hang
            head, body = read_head(conn)
            status = b"403 Forbidden"
            if head.startswith(b"PUT "):
                if b"100-continue" in head.lower():
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                while needle not in body and (chunk := conn.recv(65536)):
                    body += chunk
                seen += needle in body
                status = b"500 Internal Server Error"
            conn.sendall(b"HTTP/1.1 " + status + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    return seen


async def test_the_buffer_a_given_up_put_reads_outlives_its_tier(s3: S3Server) -> None:
    """The S3 SDK re-reads a PUT's body from the lane's staging buffer on every retry, also
    after the tier gave the PUT up and closed: that buffer lives on with the agent (a lane
    collected with it unmapped its buffer and crashed a test run in a curl thread)."""
    slow, spec = silent_s3(s3)
    body = payload(100 * KiB, seed=7)
    try:
        async with opened(spec) as tier:
            assert not await tier.put("x", memoryview(body), META)
            lanes = list(tier._lanes)
            await until(lambda: all(lane.pending == 0 for lane in lanes))
            assert sum(lane.agent.unfinished for lane in lanes) == 1
        # Closed with the PUT still running: only that lane's buffer is still mapped.
        assert sorted(lane.staging.closed for lane in lanes) == [False] + [True] * (len(lanes) - 1)
        del tier
        lanes.clear()  # nothing of ours holds the lanes now
        gc.collect()
        # Each 500 brings a retry that reads the body again, from a buffer whose lane is
        # gone: three bodies, in case the first connection waiting is an attempt the SDK
        # had already timed out (its retry then read the body before the collection).
        needle = bytes(body[300:500])
        assert await asyncio.to_thread(answer_puts_with_500, slow, needle, 3) == 3
    finally:
        slow.close()


async def until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60  # only detects a hang
    while not condition():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)


def test_missing_bucket_is_a_config_error(s3: S3Server) -> None:
    async def build() -> None:
        async with opened(obj_spec(s3, "no-such-bucket-here", capacity="1MiB")):
            pass

    with pytest.raises(ConfigError, match="no-such-bucket-here"):
        asyncio.run(build())


def test_options_are_checked(s3: S3Server) -> None:
    with pytest.raises(ConfigError, match="file backends only"):
        registry.build(TierSpec.parse(obj_spec(s3, "b", capacity="1MiB", direct="true")))
    tier, _chain = registry.build(TierSpec.parse(obj_spec(s3, "b", capacity="1MiB", lanes=2)))
    assert tier.name == "nixl" and tier.opts.lanes == 2  # type: ignore[attr-defined]
