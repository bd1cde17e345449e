"""Client configuration shared by both clients: timeouts, retry policy, backoff.

Strategy: plain frozen dataclasses and pure functions, so `Client` and `AsyncClient` take
the same arguments and decide the same way; only sleeping and waiting differ between them.
"""

from __future__ import annotations

import random
import ssl
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from lmproto import Generation

from ._exceptions import (
    InvalidRequest,
    NetworkError,
    TimeoutException,
    TransportError,
)
from ._placement import Address
from ._tls import SslOption, client_context

DEFAULT_PORT = 65432
"""LMCache's customary ``lm://`` port."""

ProtocolName = Literal["v0", "v1"]
ExistManyMode = Literal["auto", "always", "never"]


class Timeout:
    """Seconds a call, and each kind of wait in it, may take; nothing hangs forever.

    ``Timeout(10.0)`` sets all five; keywords override one, e.g. ``Timeout(30, connect=2)``.

    - ``total``: the deadline of one call. Everything the call does (waiting for a free
      connection, connecting, sending, waiting for and reading replies, retries and the
      backoff before each) ends within it: each wait below is cut to what is left, and a
      retry whose backoff would end past it is not made. So a server that is down costs a
      call at most ``total`` (and, with several servers, is then skipped for a while).
    - ``connect``: one attempt to open a connection.
    - ``read`` and ``write``: each wait for the socket to make progress (as in httpx).
    - ``pool``: how long a `Client` thread waits for a free connection when all
      ``max_connections`` are busy.
    """

    __slots__ = ("connect", "pool", "read", "total", "write")

    def __init__(
        self,
        timeout: float = 30.0,
        *,
        connect: float | None = None,
        read: float | None = None,
        write: float | None = None,
        pool: float | None = None,
        total: float | None = None,
    ) -> None:
        self.connect = _seconds("connect", timeout if connect is None else connect)
        self.read = _seconds("read", timeout if read is None else read)
        self.write = _seconds("write", timeout if write is None else write)
        self.pool = _seconds("pool", timeout if pool is None else pool)
        self.total = _seconds("total", timeout if total is None else total)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Timeout) and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        c, r, w, p, t = self._fields()
        return f"Timeout(connect={c}, read={r}, write={w}, pool={p}, total={t})"

    def _fields(self) -> tuple[float, float, float, float, float]:
        return self.connect, self.read, self.write, self.pool, self.total


def _seconds(name: str, value: float) -> float:
    if not value > 0:
        raise InvalidRequest(f"timeout {name}={value!r} must be a positive number of seconds")
    return float(value)


DEFAULT_TIMEOUT = Timeout(30.0, connect=5.0)


def wait_limit(deadline: float, limit: float, expired: type[TimeoutException]) -> float:
    """Seconds the next wait may take: ``limit``, cut to what is left before the call's
    ``deadline`` (``time.monotonic()``); raises ``expired`` when nothing is left."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise expired("the call's deadline passed (Timeout.total)")
    return min(limit, left)


def compute_backoff(
    attempt: int, *, base: float = 0.05, cap: float = 2.0, rand: Callable[[], float] = random.random
) -> float:
    """Seconds to wait before retry number ``attempt + 1`` (``attempt`` counts from 0).

    Exponential with "equal jitter": the ceiling doubles from ``base`` up to ``cap`` and the
    delay is drawn from the upper half of ``[0, ceiling]``, so it always grows with the
    attempt yet clients restarted together do not retry in lockstep. Always in
    ``[base / 2, cap]``; pure when ``rand`` is.
    """
    if attempt < 0:
        raise ValueError("attempt counts from 0")
    ceiling = min(cap, base * 2.0 ** min(attempt, 64))
    return ceiling * (0.5 + 0.5 * rand())


@dataclass(frozen=True, slots=True)
class Retry:
    """How a failed exchange is retried on a fresh connection.

    Every lm:// operation is idempotent (PUT rewrites the same bytes), so any operation may
    be retried. Retried: network errors (refused, reset, EOF, EPIPE). Timeouts only with
    ``on_timeout=True``: a server that is merely slow would otherwise see the same work
    again, and a connect timeout means the host did not answer the kernel's own SYN
    retransmissions during the wait, so another attempt would only double what a host
    that is down costs the call. Server errors and protocol errors are never retried.
    Retries and their backoff also end at the call's deadline (`Timeout` ``total``).
    """

    retries: int = 3
    base: float = 0.05
    cap: float = 2.0
    on_timeout: bool = False

    def __post_init__(self) -> None:
        if self.retries < 0 or not 0 < self.base <= self.cap:
            raise InvalidRequest(f"invalid retry policy {self!r}")

    def delay(self, exc: TransportError, attempt: int) -> float | None:
        """Seconds to wait before retrying after failed attempt ``attempt``, or None to give up."""
        if attempt >= self.retries or not self.retryable(exc):
            return None
        return compute_backoff(attempt, base=self.base, cap=self.cap)

    def retryable(self, exc: TransportError) -> bool:
        if isinstance(exc, NetworkError):
            return True
        return self.on_timeout and isinstance(exc, TimeoutException)


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a client was configured with, validated once."""

    servers: tuple[Address, ...]
    generation: Generation
    timeout: Timeout
    retry: Retry
    max_connections: int
    exist_many: ExistManyMode
    probe_timeout: float
    ssl_context: ssl.SSLContext | None = None  # TLS (lms://) when set; see _tls.py

    @property
    def host(self) -> str:
        """The first server's host (the only one for a single-server client)."""
        return self.servers[0].host

    @property
    def port(self) -> int:
        return self.servers[0].port


ServerSpec = str | tuple[str, int]
"""A server given to a client: ``"host:port"``, ``"lm://host:port"`` or ``(host, port)``."""


def make_settings(
    servers: Sequence[ServerSpec],
    protocol: ProtocolName | Generation,
    timeout: float | Timeout,
    retry: int | Retry,
    max_connections: int,
    exist_many: ExistManyMode,
    probe_timeout: float,
    tls: SslOption = None,
) -> Settings:
    if isinstance(protocol, Generation):
        generation = protocol
    elif protocol in ("v0", "v1"):
        generation = Generation.V0 if protocol == "v0" else Generation.V1
    else:
        raise InvalidRequest(f"protocol must be 'v0' or 'v1', not {protocol!r}")
    addresses = tuple(_address(spec) for spec in servers)
    if not addresses:
        raise InvalidRequest("at least one server is needed")
    if len(set(addresses)) != len(addresses):
        raise InvalidRequest(f"a server is listed twice: {', '.join(map(str, addresses))}")
    if max_connections < 1:
        raise InvalidRequest("max_connections must be at least 1")
    if exist_many not in ("auto", "always", "never"):
        raise InvalidRequest(f"exist_many must be 'auto', 'always' or 'never', not {exist_many!r}")
    if not probe_timeout > 0:
        raise InvalidRequest("probe_timeout must be positive")
    return Settings(
        servers=addresses,
        generation=generation,
        timeout=timeout if isinstance(timeout, Timeout) else Timeout(float(timeout)),
        retry=retry if isinstance(retry, Retry) else Retry(retries=retry),
        max_connections=max_connections,
        exist_many=exist_many,
        probe_timeout=probe_timeout,
        ssl_context=client_context(tls),
    )


def _address(spec: ServerSpec) -> Address:
    if isinstance(spec, str):
        spec = spec.removeprefix("lm://").removeprefix("lms://")
        found = parse_servers(f"lm://{spec}")
        if len(found) != 1:
            raise InvalidRequest(f"expected one host:port, not {spec!r}")
        return found[0]
    host, port = spec
    if not host or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidRequest(f"bad server address {spec!r} (port must be 1-65535)")
    return Address(host, port)


def parse_servers(url: str) -> list[Address]:
    """``lm://host[:port][,host[:port]...]`` (LMCACHE_REMOTE_URL's form, with a comma-separated
    server list) to addresses; the port defaults to 65432; IPv6 hosts go in brackets."""
    scheme, sep, rest = url.partition("://")
    if scheme not in ("lm", "lms") or not sep:
        raise InvalidRequest(f"expected lm://host[:port][,host[:port]...], not {url!r}")
    rest = rest.rstrip("/")
    addresses = []
    for part in rest.split(","):
        part = part.strip()
        if part.startswith("["):
            host, bracket, tail = part[1:].partition("]")
            if not bracket or (tail and not tail.startswith(":")):
                raise InvalidRequest(f"bad IPv6 address in {url!r}")
            port_text = tail[1:]
        else:
            host, _, port_text = part.partition(":")
        if not host:
            raise InvalidRequest(f"missing host in {url!r}")
        try:
            port = int(port_text) if port_text else DEFAULT_PORT
        except ValueError:
            raise InvalidRequest(f"bad port in {url!r}") from None
        if not 0 < port < 65536:
            raise InvalidRequest(f"port {port} out of range in {url!r}")
        addresses.append(Address(host, port))
    return addresses


def url_wants_tls(url: str) -> bool:
    """``lms://`` asks for TLS."""
    return url.partition("://")[0] == "lms"
