"""Incremental (sans-IO) decoders: feed any split of a byte stream, get whole frames.

Strategy: one bytearray buffer and a read offset; frames are cut out only once complete,
so feeding a stream one byte at a time yields exactly the frames feeding it whole does.
``feed(b"")`` marks end of stream; a frame cut short by it raises RemoteProtocolError.

These decoders copy bodies out of their buffer, which suits tests, tools and small
control replies. Large object bodies are read by the server and clients straight into
their final buffers after decoding the header with `decode_request`/`decode_reply`.
"""

from __future__ import annotations

import enum
from typing import Generic, TypeVar

from ._constants import INT32_MAX, REPLY_SIZE, REQUEST_SIZE, Generation
from ._decode import decode_reply, decode_request, detect_generation
from ._errors import LocalProtocolError, RemoteProtocolError
from ._frames import Reply, Request


class _Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"


NEED_DATA = _Sentinel.NEED_DATA
"""Returned by ``next_frame`` when more bytes must be fed first."""

H = TypeVar("H", Request, Reply)


class _Decoder(Generic[H]):
    def __init__(self, generation: Generation | None, max_body: int) -> None:
        if not 0 <= max_body <= INT32_MAX:
            raise LocalProtocolError(f"max_body {max_body} out of range")
        self.generation = generation
        self.max_body = max_body
        self._buf = bytearray()
        self._pos = 0
        self._header: H | None = None
        self._eof = False

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof:
            if data:
                raise LocalProtocolError("data fed after end of stream")
            return
        if not data:
            self._eof = True
            return
        if self._pos and self._pos > len(self._buf) // 2:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes fed but not yet returned in a frame."""
        return len(self._buf) - self._pos

    def next_frame(self) -> tuple[H, bytes] | _Sentinel:
        if self._header is None:
            if self.generation is None:
                self.generation = detect_generation(self._buf, self._pos)
                if self.generation is None:
                    return self._need_data()
            size = self._header_size(self.generation)
            if self.buffered < size:
                return self._need_data()
            header = self._decode(self.generation)
            if header.length > self.max_body:
                raise RemoteProtocolError(
                    f"announced body of {header.length} bytes exceeds the limit of {self.max_body}"
                )
            self._pos += size
            self._header = header
        length = self._header.length
        if self.buffered < length:
            return self._need_data()
        body = bytes(self._buf[self._pos : self._pos + length])
        self._pos += length
        header, self._header = self._header, None
        return header, body

    def _need_data(self) -> _Sentinel:
        if self._eof and (self.buffered or self._header is not None):
            raise RemoteProtocolError(f"stream ended inside a frame ({self.buffered} bytes left)")
        return NEED_DATA

    def _header_size(self, generation: Generation) -> int:
        raise NotImplementedError

    def _decode(self, generation: Generation) -> H:
        raise NotImplementedError


class RequestDecoder(_Decoder[Request]):
    """Requests as a server sees them; ``generation=None`` detects it from the first header."""

    def __init__(self, generation: Generation | None = None, *, max_body: int = INT32_MAX) -> None:
        super().__init__(generation, max_body)

    def _header_size(self, generation: Generation) -> int:
        return REQUEST_SIZE[generation]

    def _decode(self, generation: Generation) -> Request:
        return decode_request(self._buf, generation, self._pos)


class ReplyDecoder(_Decoder[Reply]):
    """Replies as a client sees them; the generation is the one the client speaks."""

    def __init__(self, generation: Generation, *, max_body: int = INT32_MAX) -> None:
        super().__init__(generation, max_body)

    def _header_size(self, generation: Generation) -> int:
        return REPLY_SIZE[generation]

    def _decode(self, generation: Generation) -> Reply:
        return decode_reply(self._buf, generation, self._pos)
