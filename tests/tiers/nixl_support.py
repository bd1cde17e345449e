"""Helpers for the NIXL tier tests: a local S3 server (moto), tier construction, round trips."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from lmproto import ObjectMeta
from lmserver.storage.tiers.nixl import NixlTier
from lmserver.storage.tiers.spec import TierSpec

pytest.importorskip("nixl_cu12", reason="the nixl extra is not installed")

META = ObjectMeta(1, 2, (3, 4, 5, 6), 7)
SIZES = (0, 1, 4096, 4 << 20, 32 << 20)


class S3Server:
    """moto's S3 server on 127.0.0.1, an ephemeral port, run in a thread by the test."""

    def __init__(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        host, port = self._server._server.server_address  # the port the OS chose
        self.endpoint = f"http://{host}:{port}"
        import boto3

        self.s3: Any = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="test",
            aws_secret_access_key="test",
        )

    def bucket(self) -> str:
        name = f"lms-{uuid.uuid4().hex[:12]}"
        self.s3.create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self._server.stop()


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    yield server
    server.stop()


def obj_spec(s3: S3Server, bucket: str, prefix: str = "kv", **options: Any) -> str:
    # A generous timeout: this shared machine is slow, and timeouts have their own test.
    opts = {"endpoint": s3.endpoint, "access_key": "test", "secret_key": "test", "timeout": "60"}
    opts.update({k: str(v) for k, v in options.items()})
    query = "&".join(f"{k}={v}" for k, v in opts.items())
    return f"nixl:s3://{bucket}/{prefix}?{query}"


def file_spec(path: os.PathLike[str] | str, **options: Any) -> str:
    query = "&".join(f"{k}={v}" for k, v in options.items())
    return f"nixl:{os.fspath(path)}" + (f"?{query}" if query else "")


@contextlib.asynccontextmanager
async def opened(text: str) -> AsyncIterator[NixlTier]:
    spec = TierSpec.parse(text)
    tier = NixlTier.from_spec(spec)
    spec.finish()
    await tier.open()
    try:
        yield tier
    finally:
        await tier.close()


def payload(size: int, seed: int = 0) -> bytearray:
    """Deterministic, non-repeating-ish bytes (a seeded pattern, cheap for 32 MiB)."""
    block = bytes((i * 131 + seed * 17 + (i >> 8)) & 0xFF for i in range(4096))
    reps, rest = divmod(size, len(block))
    return bytearray(block * reps + block[:rest])


class Sink:
    """An ``alloc`` for get_into that keeps the buffer it handed out."""

    def __init__(self) -> None:
        self.buf: bytearray | None = None

    def __call__(self, n: int) -> memoryview:
        self.buf = bytearray(n)
        return memoryview(self.buf)


async def fetch(tier: NixlTier, key: str) -> tuple[ObjectMeta, bytearray] | None:
    sink = Sink()
    meta = await tier.get_into(key, sink)
    if meta is None:
        return None
    assert sink.buf is not None
    return meta, sink.buf
