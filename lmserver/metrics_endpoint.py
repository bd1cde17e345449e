"""``/metrics`` over HTTP on the server's own event loop (``--metrics-port``).

Strategy: a scrape is one small HTTP/1.1 exchange, so the endpoint is a few asyncio stream
handlers, not a thread per connection (prometheus_client's server: 2,000 silent sockets made
2,000 threads, and scrapes ran beside the event loop, fighting it for the GIL). Everything a
peer can hold is bounded:

* at most ``MAX_CONNECTIONS`` connections, from ``--allow`` addresses only; at the limit a
  newcomer displaces the connection that has waited longest for a request;
* a request head of at most ``MAX_HEAD`` bytes, complete within ``REQUEST_TIMEOUT_S`` of the
  connection (or its previous response); a response the peer does not read within
  ``WRITE_TIMEOUT_S`` closes the connection;
* one rendering serves every scrape waiting for it, and renderings are at least
  ``RENDER_INTERVAL_S`` apart: each answer is rendered after its request arrived (never
  stale), and a storm of scrapers costs the event loop one rendering per interval.

``GET`` and ``HEAD`` of ``/metrics`` are answered 200; any other path 404, any other method 405.
"""

from __future__ import annotations

import asyncio
import contextlib
import math

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .state import ServerState

log = structlog.get_logger("lmserver.metrics")

MAX_CONNECTIONS = 16
"""Metrics connections open at once (Prometheus keeps one per server it scrapes)."""

MAX_HEAD = 8 * 1024
"""Largest request line and headers (a scrape's are a few hundred bytes)."""

REQUEST_TIMEOUT_S = 5.0
"""A connection must deliver a complete request head this soon after it opens or after its
previous response; Prometheus reconnects for its next scrape (15 s apart by default)."""

WRITE_TIMEOUT_S = 10.0
"""A response the peer has not read by then closes its connection."""

RENDER_INTERVAL_S = 1.0
"""Least time between two renderings (a rendering costs the loop ~1-3 ms)."""

_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
}


class Renderer:
    """The exposition text of ``registry``, shared by concurrent scrapes and rate-limited."""

    def __init__(self, registry: CollectorRegistry, interval: float = RENDER_INTERVAL_S) -> None:
        self.registry = registry
        self.interval = interval
        self._rendered_at = -math.inf
        self._next: asyncio.Future[bytes] | None = None

    async def render(self) -> bytes:
        """A rendering begun after this call (so never older than the request)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._render_when_due())
        return await asyncio.shield(self._next)

    async def _render_when_due(self) -> bytes:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(max(0.0, self._rendered_at + self.interval - loop.time()))
        self._next = None  # scrapes from now on wait for the next rendering
        self._rendered_at = loop.time()
        return generate_latest(self.registry)

    def close(self) -> None:
        if self._next is not None:
            self._next.cancel()
            self._next = None


class MetricsEndpoint:
    """The HTTP listener of ``--metrics-port``."""

    def __init__(self, state: ServerState, registry: CollectorRegistry) -> None:
        self.state = state
        self.counters = state.counters
        self.renderer = Renderer(registry)
        self._server: asyncio.Server | None = None
        # Open connections: since when each has waited for a request (None: answering one).
        self._open: dict[asyncio.StreamWriter, float | None] = {}
        self.port = 0

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=MAX_HEAD, backlog=64, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        self.renderer.close()
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            writer.transport.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        peer = writer.get_extra_info("peername")
        if not self.state.access.allows(peer):
            self.counters["metrics_connections_refused"] += 1
            return False
        if len(self._open) >= MAX_CONNECTIONS:
            waiting = [(since, other) for other, since in self._open.items() if since is not None]
            if not waiting:
                self.counters["metrics_connections_refused"] += 1
                return False
            _, oldest = min(waiting, key=lambda row: row[0])
            self.counters["metrics_connections_displaced"] += 1
            oldest.transport.abort()
            del self._open[oldest]
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.transport.abort()
            return
        loop = asyncio.get_running_loop()
        try:
            keep_alive = True
            while keep_alive and not writer.transport.is_closing():
                self._open[writer] = loop.time()
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
                except TimeoutError:
                    self.counters["metrics_timeouts"] += 1
                    return
                except asyncio.LimitOverrunError:
                    await self._respond(writer, 431, b"request head too large\n", keep_alive=False)
                    return
                except (asyncio.IncompleteReadError, ConnectionError):
                    return  # the peer closed (or was displaced)
                self._open[writer] = None
                keep_alive = await self._answer(head, writer)
        except (ConnectionError, TimeoutError):
            pass  # a peer that does not read its response, or went away
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; returns whether the connection stays open."""
        lines = head.decode("latin-1").split("\r\n")
        request = lines[0].split(" ")
        if len(request) != 3 or not request[2].startswith("HTTP/1."):
            self.counters["metrics_bad_requests"] += 1
            return await self._respond(writer, 400, b"bad request\n", keep_alive=False)
        method, target, version = request
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip().lower()
        connection = headers.get("connection", "")
        keep_alive = connection == "keep-alive" if version == "HTTP/1.0" else connection != "close"
        if headers.get("content-length", "0") != "0" or "transfer-encoding" in headers:
            keep_alive = False  # a request body is not read: the stream cannot be reused
        if target.partition("?")[0] != "/metrics":
            self.counters["metrics_bad_requests"] += 1
            return await self._respond(writer, 404, b"not found: metrics are at /metrics\n", keep_alive)
        if method not in ("GET", "HEAD"):
            self.counters["metrics_bad_requests"] += 1
            return await self._respond(writer, 405, b"only GET and HEAD\n", keep_alive, allow="GET, HEAD")
        try:
            body = await self.renderer.render()
        except Exception as exc:  # a collector's bug: say so, keep serving
            log.warning("metrics rendering failed", error=repr(exc))
            return await self._respond(writer, 500, b"rendering failed\n", keep_alive=False)
        self.counters["metrics_scrapes"] += 1
        return await self._respond(
            writer, 200, body, keep_alive, content_type=CONTENT_TYPE_LATEST, head_only=method == "HEAD"
        )

    async def _respond(
        self,
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        keep_alive: bool,
        *,
        content_type: str = "text/plain; charset=utf-8",
        head_only: bool = False,
        allow: str | None = None,
    ) -> bool:
        head = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
        ]
        if allow is not None:
            head.append(f"Allow: {allow}")
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        with contextlib.suppress(ConnectionError):
            await asyncio.wait_for(writer.drain(), WRITE_TIMEOUT_S)
            return keep_alive
        return False
