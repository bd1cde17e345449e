"""The TLS listener's context (``--tls-port``), for lmclient (LMCache's connectors speak plain TCP).

The listener runs on the same event loop and serves the same ``LMProtocol`` as the plain
one; only the transport differs. What the protocol must know about it (write-buffer
limits, when a sent object may be unpinned) is in ``write_buffer_high_water``.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import Any

HANDSHAKE_TIMEOUT_S = 10.0
"""A peer that has not finished its handshake by then is dropped (it holds a socket, a slot of
--max-connections and an SSL object)."""


def server_context(cert: Path, key: Path | None = None, client_ca: Path | None = None) -> ssl.SSLContext:
    """TLS 1.2+ with ``cert`` (and ``key``, unless the cert file holds it); with ``client_ca``
    every client must present a certificate signed by it."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.load_verify_locations(client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    # No TLS 1.3 session tickets: nothing resumes sessions, and a ticket arriving on an idle
    # pooled client connection would look like "the server sent something unasked".
    context.num_tickets = 0
    return context


def write_buffer_high_water(transport: asyncio.BaseTransport) -> int:
    """The high-water mark that makes ``pause_writing`` mean "something is unsent".

    A plain transport pauses when its buffer is *above* the mark, so 0 does it. An SSL
    transport (stdlib and uvloop alike) pauses when it is *at or above* the mark, so 0 would
    pause after every write with nothing left to resume it: 1 is the same meaning there.
    An SSL transport encrypts (copies) what ``write`` is given at once, so its buffer holds
    ciphertext, not the sent objects; the connection still keeps their pins until it is
    empty, which is harmless, and stops reading while it is not, which bounds its memory.
    """
    return 0 if transport.get_extra_info("ssl_object") is None else 1


class StdlibLoop(asyncio.SelectorEventLoop):
    """The standard library's event loop, with one TLS read buffer per loop, not per connection.

    Its SSL protocol receives ciphertext into a 256 KiB ``bytearray`` of its own, allocated
    (and zero-filled, so resident) for every connection: an idle TLS connection cost ~270 KiB
    of RSS, a handshake in progress ~313 KiB (uvloop's buffer is malloc'd and never touched
    beyond what arrives). The buffer only carries bytes from one ``recv_into`` to the memory
    BIO that ``buffer_updated`` copies them into at once, within one callback, so the
    connections of one loop can share one. This overrides a private method and sets private
    attributes of ``asyncio.sslproto.SSLProtocol`` (Python 3.11-3.13): where they differ,
    nothing is changed, and ``tests/ops/test_tls.py`` measures the cost again.
    """

    def __init__(self) -> None:
        super().__init__()
        self._tls_read_buffer = bytearray(256 * 1024)  # SSLProtocol.max_size
        self._tls_read_view = memoryview(self._tls_read_buffer)

    def _make_ssl_transport(self, *args: Any, **kwargs: Any) -> Any:
        transport = super()._make_ssl_transport(*args, **kwargs)  # type: ignore[misc]
        protocol = getattr(transport, "_ssl_protocol", None)
        if len(getattr(protocol, "_ssl_buffer", b"")) == len(self._tls_read_buffer):
            protocol._ssl_buffer = self._tls_read_buffer  # type: ignore[union-attr]
            protocol._ssl_buffer_view = self._tls_read_view  # type: ignore[union-attr]
        return transport
