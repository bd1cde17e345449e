"""The fake Hub's storage service (``fakehub.cas``): the real hf_xet uploads and reads through
it over HTTP (the current API and the previous generation's fallbacks), storage tokens expire
and are refreshed, and every bad upload or read has a defined answer with nothing stored."""

from __future__ import annotations

import json
import os
import struct
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import FakeHub, cas
from fakehub.fixtures import BUCKET

from lmproto import ObjectMeta

META = ObjectMeta(1, 2, (3, 4, 5, 6), 0)
NO_SUCH_HASH = "ab" * 32


async def round_trip(tier, key: str, blob: bytes) -> bytes:
    assert await tier.put(key, memoryview(blob), META)
    got: list[bytearray] = []

    def alloc(n: int) -> memoryview:
        got.append(bytearray(n))
        return memoryview(got[-1])

    assert await tier.get_into(key, alloc) == META
    return bytes(got[-1])


def call(hub: FakeHub, method: str, path: str, body: bytes = b"", **headers: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{hub.endpoint}/cas{path}", data=body or None, method=method)
    for name, value in headers.items():
        request.add_header(name.replace("_", "-"), value)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def bearer(hub: FakeHub) -> str:
    return f"Bearer {hub.cas.issue_token()[0]}"


def shard_naming(xorb: str) -> bytes:
    """A well-formed MDB shard whose one file uses chunk 0 of ``xorb``."""
    raw_hash = bytes.fromhex(NO_SUCH_HASH)
    header = cas.SHARD_TAG + struct.pack("<QQ", 2, 200)
    file_entry = raw_hash + struct.pack("<IIQ", 0, 1, 0)
    raw_xorb = b"".join(int(xorb[i : i + 16], 16).to_bytes(8, "little") for i in range(0, 64, 16))
    segment = raw_xorb + struct.pack("<IIII", 0, 10, 0, 1)
    return header + file_entry + segment + cas.BOOKEND + bytes(16)


async def test_a_previous_generation_service_is_used_through_hf_xets_fallbacks(
    hub: FakeHub, make_tier
) -> None:
    hub.legacy_storage = True  # no upload grants, no /v2 routes
    tier = await make_tier()
    blob = os.urandom(3 << 20)
    assert await round_trip(tier, "legacy", blob) == blob
    paths = [path for _, path in hub.requests]
    assert "cas-xorb" in hub.routes_seen()  # the direct upload, after the grant's 404
    assert any(p.startswith("POST /cas/v1/shards") for p in paths)
    assert any(p.startswith("GET /cas/v1/reconstructions/") for p in paths)


async def test_short_lived_storage_tokens_are_refreshed(tmp_path, make_tier) -> None:
    # hf_xet treats a token as expired from 30 s before its end: these need a refresh at once.
    with FakeHub(tmp_path / "short", xet_token_ttl_s=30.0) as hub:
        hub.create(BUCKET)
        tier = await make_tier(endpoint=hub.endpoint)
        for n in range(3):
            blob = os.urandom((n + 1) << 20)
            assert await round_trip(tier, f"k{n}", blob) == blob
        await tier.close()
        assert hub.cas.tokens_issued > 3  # more than one per upload and read session
        assert hub.cas.rejected_tokens == 0


def test_storage_requests_need_a_live_token(hub: FakeHub) -> None:
    route = f"/v1/reconstructions/{NO_SUCH_HASH}"
    assert call(hub, "GET", route)[0] == 401
    assert call(hub, "GET", route, Authorization="Bearer forged")[0] == 401
    token, _ = hub.cas.issue_token()
    hub.cas._tokens[token] = time.time() - 1  # expired
    assert call(hub, "GET", route, Authorization=f"Bearer {token}")[0] == 401
    assert call(hub, "GET", route, Authorization=bearer(hub))[0] == 404  # live: no such file


def test_bad_uploads_are_refused_and_store_nothing(hub: FakeHub) -> None:
    auth = bearer(hub)
    xorb_route = f"/v1/xorbs/default/{NO_SUCH_HASH}"
    assert call(hub, "POST", xorb_route, b"not a xorb", Authorization=auth)[0] == 400
    truncated = bytes([0, 100, 0, 0, 0, 100, 0, 0]) + b"short"  # announces 100 bytes
    assert call(hub, "POST", xorb_route, truncated, Authorization=auth)[0] == 400
    assert call(hub, "POST", "/v1/shards", b"not a shard", Authorization=auth)[0] == 400
    assert call(hub, "POST", "/v2/shards", shard_naming(NO_SUCH_HASH), Authorization=auth)[0] == 400
    assert hub.cas.file_size(NO_SUCH_HASH) is None
    assert list(hub.cas.xorb_dir.iterdir()) == []

    status, body = call(
        hub, "POST", f"/v1/xorb-grants/default/{NO_SUCH_HASH}", b'{"length": 16}', Authorization=auth
    )
    assert status == 201
    grant = json.loads(body)
    upload = grant["url"].split("/cas", 1)[1]
    assert call(hub, "PUT", upload, b"wrong length")[0] == 400
    commit = f"/v1/xorb-commits/default/{NO_SUCH_HASH}/grant/{grant['id']}"
    assert call(hub, "POST", commit, Authorization=auth)[0] == 404  # nothing was uploaded
    assert call(hub, "PUT", upload, bytes(16))[0] == 403  # the grant ended with its commit
    assert list(hub.cas.xorb_dir.iterdir()) == []


async def test_reads_outside_a_file_or_xorb_are_refused(hub: FakeHub, make_tier) -> None:
    tier = await make_tier()
    blob = os.urandom(100_000)
    assert await round_trip(tier, "k", blob) == blob
    (record,) = hub.files(BUCKET).values()
    auth = bearer(hub)
    route = f"/v1/reconstructions/{record.xet_hash}"
    status, body = call(hub, "GET", route, Authorization=auth, Range="bytes=10-19")
    assert status == 200 and json.loads(body)["terms"]
    assert call(hub, "GET", route, Authorization=auth, Range=f"bytes={record.size}-")[0] == 416
    assert call(hub, "GET", route, Authorization=auth, Range="bytes=9-3")[0] == 416
    (xorb,) = [p.name for p in hub.cas.xorb_dir.iterdir()]
    assert call(hub, "GET", f"/fetch/{xorb}", Range="bytes=0-7")[0] == 206
    assert call(hub, "GET", f"/fetch/{xorb}", Range="bytes=99999999-99999999")[0] == 416
    assert call(hub, "GET", f"/fetch/{xorb}")[0] == 416  # a fetch names its range
    assert call(hub, "GET", f"/fetch/{NO_SUCH_HASH}", Range="bytes=0-7")[0] == 404
