"""torch tensors <-> v1 object metadata. torch is imported only when these run.

A tensor travels as its raw bytes (CPU, contiguous, no copy) with its dtype and up to 4
dimensions in the v1 header, so ``get_tensor`` can allocate the right tensor before the
body arrives and receive straight into it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from lmproto import DType, MemoryFormat, ObjectMeta, Reply

from ._exceptions import InvalidRequest, TensorMismatch

if TYPE_CHECKING:
    import torch

_TO_WIRE: dict[Any, DType] = {}
_FROM_WIRE: dict[int, Any] = {}


def _tables() -> tuple[dict[Any, DType], dict[int, Any]]:
    if not _TO_WIRE:
        import torch

        pairs = [
            (DType.FLOAT16, torch.float16),
            (DType.BFLOAT16, torch.bfloat16),
            (DType.FLOAT32, torch.float32),
            (DType.FLOAT64, torch.float64),
            (DType.UINT8, torch.uint8),
            (DType.FLOAT8_E4M3FN, torch.float8_e4m3fn),
            (DType.FLOAT8_E5M2, torch.float8_e5m2),
        ]
        _FROM_WIRE.update({int(wire): dtype for wire, dtype in pairs})
        _FROM_WIRE[int(DType.HALF)] = torch.float16  # LMCache's older name for float16
        _TO_WIRE.update({dtype: wire for wire, dtype in pairs})
    return _TO_WIRE, _FROM_WIRE


def _check_cpu_contiguous(tensor: torch.Tensor) -> None:
    if tensor.device.type != "cpu":
        raise InvalidRequest(f"tensor is on {tensor.device}; move it to the CPU first")
    if not tensor.is_contiguous():
        raise InvalidRequest("tensor is not contiguous; call .contiguous() first")


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a CPU contiguous tensor as a writable flat memoryview (no copy)."""
    import torch

    _check_cpu_contiguous(tensor)
    flat = tensor.detach().reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data


def tensor_meta(tensor: torch.Tensor, fmt: int = MemoryFormat.UNDEFINED) -> ObjectMeta:
    """v1 metadata describing ``tensor``; refuses what the header cannot carry."""
    _check_cpu_contiguous(tensor)
    wire = _tables()[0].get(tensor.dtype)
    if wire is None:
        names = ", ".join(str(d) for d in _tables()[0])
        raise InvalidRequest(f"dtype {tensor.dtype} has no lm:// code (supported: {names})")
    if tensor.dim() > 4:
        raise InvalidRequest(f"tensor has {tensor.dim()} dimensions; the v1 header carries at most 4")
    if tensor.numel() == 0:
        raise InvalidRequest("an empty tensor's shape cannot be carried (zero means 'no dimension')")
    shape = tuple(tensor.shape) + (0,) * (4 - tensor.dim())
    return ObjectMeta(int(fmt), int(wire), shape, 0)  # type: ignore[arg-type]


def _shape(meta: ObjectMeta) -> tuple[int, ...]:
    dims = list(meta.shape)
    while dims and dims[-1] == 0:
        dims.pop()
    return tuple(dims)


def _describe(reply: Reply) -> tuple[Any, tuple[int, ...]] | TensorMismatch:
    """(torch dtype, shape) of the object a GET hit announces, or why it is not a tensor."""
    dtype = _tables()[1].get(reply.meta.dtype)
    if dtype is None:
        return TensorMismatch(f"the object has no tensor metadata (dtype code {reply.meta.dtype})")
    shape = _shape(reply.meta)
    itemsize: int = dtype.itemsize
    if math.prod(shape) * itemsize != reply.length:
        return TensorMismatch(f"metadata says {dtype} {list(shape)} but the object is {reply.length} bytes")
    return dtype, shape


class TensorSink:
    """Receives a GET hit into a new tensor (``target=None``) or into ``target``.

    Used as the reply sink: it looks at the header before any body byte is read, so a
    mismatch is refused (the body drained) without touching the target.
    """

    __slots__ = ("target", "tensor")

    def __init__(self, target: torch.Tensor | None = None) -> None:
        if target is not None:
            _check_cpu_contiguous(target)
        self.target = target
        self.tensor: torch.Tensor | None = None

    def __call__(self, reply: Reply) -> memoryview | TensorMismatch:
        described = _describe(reply)
        if isinstance(described, TensorMismatch):
            return described
        dtype, shape = described
        if self.target is None:
            import torch

            self.tensor = torch.empty(shape, dtype=dtype)
        elif self.target.dtype != dtype or tuple(self.target.shape) != shape:
            return TensorMismatch(
                f"the object is {dtype} {list(shape)}; the tensor is "
                f"{self.target.dtype} {list(self.target.shape)}"
            )
        else:
            self.tensor = self.target
        return tensor_bytes(self.tensor)
