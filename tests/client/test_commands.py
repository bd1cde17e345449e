"""Every client method, on Client and AsyncClient, in both frame generations, against a
real lmserver on loopback."""

from __future__ import annotations

from typing import Any

import pytest

from lmclient import InvalidRequest, ObjectMeta, ServerError
from lmproto import NO_META, DType, MemoryFormat, hit_prefix

KEY = "llama-3-8b@1@0@9f86d081884c7d65@bfloat16"


def test_put_then_get(client: Any) -> None:
    client.put(KEY, b"kv-bytes")  # fire-and-forget: the GET behind it sees it (in order)
    assert client.get(KEY) == b"kv-bytes"


def test_get_miss_is_none(client: Any) -> None:
    assert client.get("absent") is None
    assert client.get_with_meta("absent") is None
    assert client.get_into("absent", bytearray(8)) is None


def test_put_accepts_any_bytes_like(client: Any) -> None:
    client.put("ba", bytearray(b"one"))
    client.put("mv", memoryview(b"xxtwoxx")[2:5])
    client.put("empty", b"")
    assert [client.get(k) for k in ("ba", "mv", "empty")] == [b"one", b"two", b""]


def test_put_ack(client: Any) -> None:
    assert client.put(KEY, b"acked", ack=True) is None
    assert client.get(KEY) == b"acked"


def test_put_ack_refused_raises_server_error_and_connection_survives(
    make_client: Any, make_server_thread: Any, protocol: str
) -> None:
    server = make_server_thread(max_object_size=1024)
    client = make_client(server.host, server.port, protocol=protocol)
    with pytest.raises(ServerError) as info:
        client.put("big", b"x" * 4096, ack=True)
    assert info.value.status == 413
    assert "exceeds" in info.value.reason
    client.put("small", b"ok", ack=True)
    assert client.get("small") == b"ok"


def test_large_object_round_trip(client: Any) -> None:
    data = bytes(range(256)) * (8 * 4096)  # 8 MiB: several sendmsg and recv_into calls
    client.put("large", data, ack=True)
    assert client.get("large") == data


def test_exists_and_delete(client: Any) -> None:
    client.put(KEY, b"v", ack=True)
    assert client.exists(KEY) is True
    assert client.delete(KEY) is True
    assert client.exists(KEY) is False
    assert client.delete(KEY) is False
    assert client.get(KEY) is None


def test_exists_many(client: Any) -> None:
    keys = [f"m@1@0@{i:04x}@half" for i in range(10)]
    for key in keys[:6]:
        client.put(key, b"chunk")
    hits = client.exists_many(keys)
    assert hits == [True] * 6 + [False] * 4
    assert hit_prefix(hits) == 6
    assert client.exists_many([]) == []
    assert client.exists_many(iter(keys[:2])) == [True, True]


def test_exists_many_beyond_one_request(client: Any) -> None:
    keys = [f"k{i}" for i in range(20000)]  # more keys than one EXIST_MANY request carries
    client.put("k19999", b"x", ack=True)
    hits = client.exists_many(keys)
    assert len(hits) == 20000 and hits[-1] and not any(hits[:-1])


def test_list(client: Any) -> None:
    for key in ("a@1", "a@2", "b@1"):
        client.put(key, b"x")
    assert sorted(client.list()) == ["a@1", "a@2", "b@1"]
    assert sorted(client.list("a@")) == ["a@1", "a@2"]
    assert client.list("zzz") == []


def test_health_and_stats(client: Any) -> None:
    assert client.health() is True
    client.put(KEY, b"v", ack=True)
    stats = client.stats()
    assert isinstance(stats, dict) and stats


def test_meta_round_trip_v1(make_client: Any, server_thread: Any) -> None:
    client = make_client(server_thread.host, server_thread.port, protocol="v1")
    meta = ObjectMeta(MemoryFormat.KV_2LTD, DType.BFLOAT16, (2, 4, 16, 8), 1)
    client.put(KEY, b"\0" * 2048, meta=meta)
    data, got = client.get_with_meta(KEY)
    assert (len(data), got) == (2048, meta)
    client.put("plain", b"p")
    assert client.get_with_meta("plain") == (b"p", NO_META)


def test_v0_carries_no_meta(make_client: Any, server_thread: Any) -> None:
    client = make_client(server_thread.host, server_thread.port, protocol="v0")
    with pytest.raises(InvalidRequest, match="v0"):
        client.put(KEY, b"x", meta=ObjectMeta(1, 2, (1, 0, 0, 0), 0))
    client.put(KEY, b"x")
    assert client.get_with_meta(KEY) == (b"x", NO_META)


@pytest.mark.parametrize(
    "key", ["", " lead", "trail ", "nul\0", "k" * 151, "é" * 76], ids=lambda k: repr(k)[:12]
)
def test_bad_keys_are_refused_before_sending(client: Any, key: str) -> None:
    with pytest.raises(InvalidRequest):
        client.put(key, b"x")
    with pytest.raises(InvalidRequest):
        client.exists_many(["fine", key])
    assert client.health()  # nothing half-sent


def test_longest_key_and_unicode(client: Any) -> None:
    for key in ("k" * 150, "é" * 75, "模型@1@0@ab@half"):
        client.put(key, key.encode(), ack=True)
        assert client.get(key) == key.encode()


def test_closed_client_refuses(make_client: Any, server_thread: Any) -> None:
    client = make_client(server_thread.host, server_thread.port)
    client.put("k", b"v")
    client.close()
    with pytest.raises(Exception, match="closed"):
        client.get("k")
