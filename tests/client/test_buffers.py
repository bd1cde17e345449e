"""get_into and the torch helpers: receiving straight into caller-owned memory."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from lmclient import BufferTooSmall, InvalidRequest, TensorMismatch

DATA = bytes(range(256)) * 64  # 16 KiB
BIG = bytes(range(251)) * 4096  # ~1 MiB: larger than the staging buffer


@pytest.mark.parametrize("data", [DATA, BIG], ids=["16KiB", "1MiB"])
def test_get_into_bytearray_and_memoryview(client: Any, data: bytes) -> None:
    client.put("k", data)
    exact = bytearray(len(data))
    assert client.get_into("k", exact) == len(data)
    assert exact == data
    roomy = bytearray(len(data) + 100)
    window = memoryview(roomy)[50:]
    assert client.get_into("k", window) == len(data)
    assert roomy[50 : 50 + len(data)] == data and roomy[:50] == bytes(50)


def test_get_into_numpy(client: Any) -> None:
    client.put("k", BIG)
    array = np.zeros(len(BIG) // 4 + 1, dtype=np.float32)  # multi-byte items, cast to bytes
    assert client.get_into("k", array) == len(BIG)
    assert array.tobytes()[: len(BIG)] == BIG


def test_get_into_torch_tensor(client: Any) -> None:
    client.put("k", DATA)
    tensor = torch.zeros(len(DATA) // 2, dtype=torch.bfloat16)  # no buffer protocol of its own
    assert client.get_into("k", tensor) == len(DATA)
    assert raw(tensor).numpy().tobytes() == DATA


def test_put_from_numpy_and_tensor(client: Any) -> None:
    array = np.arange(1000, dtype=np.float64)
    client.put("np", array)
    assert client.get("np") == array.tobytes()
    tensor = torch.arange(1000, dtype=torch.float16)
    client.put("t", tensor)
    assert client.get("t") == tensor.numpy().tobytes()


@pytest.mark.parametrize("data", [DATA, BIG], ids=["16KiB", "1MiB"])
def test_too_small_buffer_is_refused_untouched_and_the_stream_goes_on(client: Any, data: bytes) -> None:
    client.put("k", data)
    client.put("after", b"next")
    small = bytearray(b"\xaa" * 100)
    with pytest.raises(BufferTooSmall) as info:
        client.get_into("k", small)
    assert (info.value.needed, info.value.size) == (len(data), 100)
    assert small == b"\xaa" * 100
    assert client.get("after") == b"next"  # the same connection, still framed
    assert client.get_into("k", bytearray(len(data))) == len(data)


def test_buffer_kinds_refused(client: Any) -> None:
    client.put("k", b"x")
    with pytest.raises(InvalidRequest, match="read-only"):
        client.get_into("k", b"immutable")
    with pytest.raises(InvalidRequest, match="contiguous"):
        client.get_into("k", np.zeros((4, 4), dtype=np.uint8)[:, 1])
    with pytest.raises(InvalidRequest, match="str"):
        client.put("k", "text")
    with pytest.raises(InvalidRequest):
        client.get_into("k", [0, 0])
    assert client.get("k") == b"x"


# ---------------------------------------------------------------------------------------
# torch helpers

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def raw(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor (float8 has no ==), as a uint8 tensor."""
    return tensor.reshape(-1).view(torch.uint8)


@pytest.fixture
def v1_client(make_client: Any, server_thread: Any) -> Any:
    return make_client(server_thread.host, server_thread.port, protocol="v1")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (7,), (2, 3), (2, 3, 4), (2, 16, 8, 4)], ids=str)
def test_tensor_round_trip(v1_client: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    tensor = (torch.rand(shape) * 100).to(dtype)
    v1_client.put_tensor("t", tensor)
    back = v1_client.get_tensor("t")
    assert back.dtype == dtype and tuple(back.shape) == shape
    assert torch.equal(raw(back), raw(tensor))
    target = torch.zeros(shape, dtype=dtype)
    assert v1_client.get_tensor_into("t", target) is target
    assert torch.equal(raw(target), raw(tensor))


def test_tensor_helpers_miss_and_ack(v1_client: Any) -> None:
    assert v1_client.get_tensor("absent") is None
    assert v1_client.get_tensor_into("absent", torch.zeros(2)) is None
    v1_client.put_tensor("t", torch.ones(3), ack=True, fmt=4)
    _, meta = v1_client.get_with_meta("t")
    assert (meta.fmt, meta.dtype, meta.shape) == (4, 4, (3, 0, 0, 0))


def test_tensor_mismatch_leaves_target_untouched(v1_client: Any) -> None:
    v1_client.put_tensor("t", torch.ones(2, 3, dtype=torch.float32))
    for target in (torch.zeros(3, 2), torch.zeros(2, 3, dtype=torch.float16), torch.zeros(6)):
        with pytest.raises(TensorMismatch):
            v1_client.get_tensor_into("t", target)
        assert not target.any()
    v1_client.put("raw", b"no metadata")
    with pytest.raises(TensorMismatch, match="no tensor metadata"):
        v1_client.get_tensor("raw")
    assert torch.equal(v1_client.get_tensor("t"), torch.ones(2, 3))


def test_tensors_the_header_cannot_describe(v1_client: Any) -> None:
    for tensor, match in [
        (torch.zeros(2, 2, 2, 2, 2), "4"),
        (torch.zeros(4, dtype=torch.int32), "int32"),
        (torch.zeros(0), "empty"),
        (torch.zeros(4, 4).t(), "contiguous"),
        (torch.zeros(4, device="meta"), "CPU"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            v1_client.put_tensor("t", tensor)
    with pytest.raises(InvalidRequest, match="contiguous"):
        v1_client.get_tensor_into("t", torch.zeros(4, 4).t())


def test_tensor_helpers_need_v1(make_client: Any, server_thread: Any) -> None:
    client = make_client(server_thread.host, server_thread.port, protocol="v0")
    with pytest.raises(InvalidRequest, match="v1"):
        client.put_tensor("t", torch.ones(2))
    with pytest.raises(InvalidRequest, match="v1"):
        client.get_tensor("t")
    with pytest.raises(InvalidRequest, match="v1"):
        client.get_tensor_into("t", torch.ones(2))
