"""Errors raised by the codec.

    ProtocolError                 (abstract: never raised itself)
     ├── LocalProtocolError       this side asked for something the protocol cannot express
     └── RemoteProtocolError      the peer sent bytes that break the framing; the stream is
                                  out of sync and the connection must be closed

A request that is well framed but cannot be served (unknown command, key that is not
UTF-8) is *not* an error here: it decodes to a `Request` whose ``problem`` says why, so the
server can answer FAIL and keep the connection.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every codec error."""

    def __init__(self, msg: str) -> None:
        if type(self) is ProtocolError:
            raise TypeError("ProtocolError is abstract; raise a subclass")
        super().__init__(msg)


class LocalProtocolError(ProtocolError):
    """The caller asked the codec to encode something the wire cannot carry."""


class RemoteProtocolError(ProtocolError):
    """The peer's bytes cannot be framed (negative length, truncated frame)."""
