"""The HF tier's contract with the installed huggingface_hub: every method and keyword it
calls exists there, keyword-only where it passes them so, every error class it catches exists,
and the fake Hub (with its storage service) serves exactly the routes the real client sends."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("huggingface_hub")

from fakehub import ROUTES, FakeHub
from fakehub.fixtures import BUCKET

from lmproto import ObjectMeta
from lmserver.storage.tiers.hf import client

META = ObjectMeta(1, 2, (3, 4, 5, 6), 0)


def test_every_called_method_and_keyword_exists() -> None:
    from huggingface_hub import HfApi

    for method, keywords in client.CALLS.items():
        signature = inspect.signature(getattr(HfApi, method))
        params = signature.parameters
        for keyword in keywords:
            assert keyword in params, f"HfApi.{method} has no parameter {keyword!r}"
        for keyword in keywords[1:]:  # everything after bucket_id is passed by keyword
            assert params[keyword].kind in (
                params[keyword].KEYWORD_ONLY,
                params[keyword].POSITIONAL_OR_KEYWORD,
            )
        assert "token" in params and params["token"].kind is params["token"].KEYWORD_ONLY


def test_every_caught_error_class_exists() -> None:
    import huggingface_hub.errors as errors

    for name in client.CAUGHT:
        if name == "BucketBatchError" and not hasattr(errors, name):
            continue  # before 1.33: partial failures are caught by reconciliation
        assert issubclass(getattr(errors, name), Exception)
    assert issubclass(errors.BucketNotFoundError, errors.HfHubHTTPError)


def test_bucket_file_builds_from_the_fake_hubs_json() -> None:
    from fakehub import FileRec
    from huggingface_hub import BucketFile

    f = BucketFile(**FileRec(5, "ab" * 32, 1.5).as_json("p/x"))
    assert (f.path, f.size, f.xet_hash) == ("p/x", 5, "ab" * 32)
    assert f.mtime is not None


def test_streaming_reads_are_available() -> None:
    # The tier reads straight into memory where hf_xet can stream; say so if it cannot.
    assert client.STREAMING


async def test_fake_hub_serves_every_route_the_client_sends(hub: FakeHub, make_tier) -> None:
    tier = await make_tier(create=True)
    assert await tier.put("k1", memoryview(b"x" * 1000), META)
    buf = bytearray(1000)
    assert await tier.get_into("k1", lambda n: memoryview(buf)[:n]) == META
    tier._sync_listing()
    tier2 = await make_tier(read_mode="file")
    assert await tier2.get_into("k1", lambda n: memoryview(bytearray(n))) == META
    tier._client.probe()
    unknown = [path for name, path in hub.requests if name == "?"]
    assert unknown == []
    # The storage service's routes too: uploads through a grant, the v2 shard and read APIs;
    # the global dedup query is sent only for some chunks.
    storage = {"cas-xorb-grant", "cas-grant-upload", "cas-xorb-commit", "cas-shard", "cas-reconstruction"}
    assert hub.routes_seen() - {"cas-dedup"} == set(ROUTES) | storage | {"cas-fetch"}
    assert BUCKET in hub.buckets
