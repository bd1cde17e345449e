"""The TLS listener's context (``--tls-port``), for lmclient (LMCache's connectors speak plain TCP).

The listener runs on the same event loop and serves the same ``LMProtocol`` as the plain
one; only the transport differs. What the protocol must know about it (write-buffer
limits, when a sent object may be unpinned) is in ``write_buffer_high_water``.
"""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

HANDSHAKE_TIMEOUT_S = 10.0
"""A peer that has not finished its handshake by then is dropped (it holds a socket)."""


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
