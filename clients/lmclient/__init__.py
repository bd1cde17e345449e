"""lmclient: sync and async clients for lmserver and LMCache ``lm://`` servers.

``Client`` (blocking, thread-safe) and ``AsyncClient`` (asyncio) have the same methods:
put/get/get_into/get_with_meta/exists/exists_many/delete/list/health/stats, the batched
put_many/get_many/get_many_into, and the torch helpers put_tensor/get_tensor/get_tensor_into.
One client can spread keys over several servers (rendezvous hashing). Both speak either frame generation
(``protocol="v1"``, the default, or ``"v0"``), reconnect with jittered backoff, and bound
every wait with a timeout. Only the standard library and ``lmproto`` are imported; torch
only when a tensor helper runs.
"""

from lmproto import DType, MemoryFormat, ObjectMeta

from ._async import AsyncClient
from ._config import DEFAULT_PORT, Retry, Timeout, compute_backoff
from ._exceptions import (
    BufferTooSmall,
    ConnectError,
    ConnectTimeout,
    InvalidRequest,
    LMClientError,
    NetworkError,
    PoolTimeout,
    ProtocolError,
    ReadError,
    ReadTimeout,
    ServerDown,
    ServerError,
    TensorMismatch,
    TimeoutException,
    TransportError,
    WriteError,
    WriteTimeout,
)
from ._sync import Client

__all__ = [
    "DEFAULT_PORT",
    "AsyncClient",
    "BufferTooSmall",
    "Client",
    "ConnectError",
    "ConnectTimeout",
    "DType",
    "InvalidRequest",
    "LMClientError",
    "MemoryFormat",
    "NetworkError",
    "ObjectMeta",
    "PoolTimeout",
    "ProtocolError",
    "ReadError",
    "ReadTimeout",
    "Retry",
    "ServerDown",
    "ServerError",
    "TensorMismatch",
    "Timeout",
    "TimeoutException",
    "TransportError",
    "WriteError",
    "WriteTimeout",
    "compute_backoff",
]
