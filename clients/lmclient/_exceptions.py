"""Exceptions raised by lmclient.

    LMClientError
     ├── TransportError           the exchange failed; the connection it used is discarded
     │    ├── TimeoutException
     │    │    ├── ConnectTimeout
     │    │    ├── ReadTimeout
     │    │    ├── WriteTimeout
     │    │    └── PoolTimeout    (Client only) every connection stayed busy too long
     │    ├── NetworkError
     │    │    ├── ConnectError
     │    │    │    └── ServerDown  a server of several failed recently; skipped for now
     │    │    ├── ReadError      includes the server closing the connection
     │    │    └── WriteError
     │    └── ProtocolError       the peer sent bytes that are not lm:// frames
     ├── ServerError              the server answered with an error status (.status, .reason)
     ├── InvalidRequest           (also ValueError) the request cannot be expressed: bad key,
     │                            metadata on v0 frames, a buffer or tensor of the wrong kind
     ├── BufferTooSmall           (also ValueError) get_into's buffer cannot hold the object
     └── TensorMismatch           (also ValueError) the object is not a tensor of the target's
                                  dtype and shape (get_tensor_into), or has no tensor metadata

Only TransportError leaves a connection unusable; the client replaces it (retrying the
operation where the retry policy allows: see `Retry`). Every other error is raised after
the whole reply was read (an object that does not fit is drained, the caller's buffer left
untouched), so the connection goes on serving. A GET miss is not an error:
it returns None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping


class LMClientError(Exception):
    """Base class of every error lmclient raises."""


class TransportError(LMClientError):
    """The exchange with the server failed; the connection was closed and discarded."""


class TimeoutException(TransportError):
    pass


class ConnectTimeout(TimeoutException):
    pass


class ReadTimeout(TimeoutException):
    pass


class WriteTimeout(TimeoutException):
    pass


class PoolTimeout(TimeoutException):
    pass


class NetworkError(TransportError):
    pass


class ConnectError(NetworkError):
    pass


class ServerDown(ConnectError):
    """The server failed recently and is skipped until its backoff ends (several servers)."""


class ReadError(NetworkError):
    pass


class WriteError(NetworkError):
    pass


class ProtocolError(TransportError):
    """The server sent bytes that cannot be framed (e.g. a negative length)."""


class ServerError(LMClientError):
    """The server answered with an error status; ``reason`` is its error text, if any."""

    def __init__(self, status: int, reason: str = "", *, command: str = "") -> None:
        self.status = status
        self.reason = reason
        self.command = command
        what = f"{command} failed" if command else "request failed"
        super().__init__(f"{what}: status {status}" + (f": {reason}" if reason else ""))


class InvalidRequest(LMClientError, ValueError):
    """The request cannot be expressed on the wire (nothing was sent)."""


class BufferTooSmall(LMClientError, ValueError):
    """The object does not fit the caller's buffer; it was drained, the buffer is untouched."""

    def __init__(self, needed: int, size: int, message: str = "") -> None:
        self.needed = needed
        self.size = size
        super().__init__(message or f"the object is {needed} bytes; the buffer holds {size}")


class TensorMismatch(LMClientError, ValueError):
    """The stored object is not a tensor of the requested dtype and shape."""


@contextlib.contextmanager
def map_exceptions(mapping: Mapping[type[BaseException], type[LMClientError]]) -> Iterator[None]:
    """Re-raise exceptions from the socket layer as lmclient's, ``from`` the original.

    The first matching entry wins, so list subclasses (TimeoutError) before their bases
    (OSError).
    """
    try:
        yield
    except LMClientError:
        raise
    except Exception as exc:
        for source, target in mapping.items():
            if isinstance(exc, source):
                raise target(str(exc) or type(exc).__name__) from exc
        raise


# What socket-level failures mean in each phase of an exchange (for map_exceptions).
CONNECT_ERRORS: Mapping[type[BaseException], type[LMClientError]] = {
    TimeoutError: ConnectTimeout,
    OSError: ConnectError,
}
WRITE_ERRORS: Mapping[type[BaseException], type[LMClientError]] = {
    TimeoutError: WriteTimeout,
    OSError: WriteError,
}
READ_ERRORS: Mapping[type[BaseException], type[LMClientError]] = {
    TimeoutError: ReadTimeout,
    OSError: ReadError,
}
