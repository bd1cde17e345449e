"""Server configuration: one frozen dataclass, filled by the CLI or by tests directly.

Strategy: each setting has one name, its field's, and its default and choices live here
once. The command line derives every ``serve`` option from the field of the same name
(``memory_wait``: ``--memory-wait``, ``LMSERVER_MEMORY_WAIT``, ``memory-wait`` in a
``--config`` file): its default, and a ``Literal`` field's values as the option's choices,
the way uvicorn's CLI reads its choices from its config's maps. The settings of the ``--disk``
tier take their defaults and choices from the disk tier and the chain (``tiers/``), where a
``--tier disk:...`` spec reads them too.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, Field, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from .access import parse_networks
from .sizes import MAX_SIZE, format_size
from .storage.tiers.disk import (
    DEFAULT_CAPACITY,
    DEFAULT_DIRECT,
    DEFAULT_FSYNC,
    DirectPolicy,
    DiskTier,
    FsyncPolicy,
)
from .storage.tiers.errors import ConfigError
from .storage.tiers.spec import DEFAULT_QUEUE_BYTES, Full, TierSpec, default_full

DEFAULT_PORT = 65432
DEFAULT_MAX_OBJECT_SIZE = 512 * 1024**2

Protocol = Literal["auto", "v0", "v1"]
"""Frame generations: ``auto`` decides per connection from the first header."""
Loop = Literal["auto", "uvloop", "asyncio"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "console", "json"]
DISK_FULL = default_full(DiskTier.default_mode)
"""``--write-behind-full``'s default: what ``full=`` defaults to for a disk tier (``wait``)."""


def physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 * 1024**3


def default_memory_limit() -> int:
    """Half of physical memory: room for the OS page cache (the disk tier lives on it) and
    the rest of the host, and far from the OOM killer that ends upstream servers."""
    return physical_memory() // 2


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    protocol: Protocol = "auto"
    # Memory tier
    memory_limit: int = field(default_factory=default_memory_limit)
    max_object_size: int = DEFAULT_MAX_OBJECT_SIZE
    # Disk tier (None: memory only), with a disk tier's own defaults
    disk: Path | None = None
    disk_limit: int = DEFAULT_CAPACITY
    fsync: FsyncPolicy = DEFAULT_FSYNC
    disk_direct: DirectPolicy = DEFAULT_DIRECT  # O_DIRECT writes of large objects
    # Bytes of objects queued for the disk tier's writes (write-behind and demotion); past
    # it write_behind_full decides: wait (throttle the PUT's connection) or skip (count).
    # The chain's queue= and full= of any tier, with their defaults for the disk's mode.
    write_behind_limit: int = DEFAULT_QUEUE_BYTES
    write_behind_full: Full = DISK_FULL
    # Memory objects waiting for tier writes may hold (None: half of memory_limit).
    dirty_limit: int | None = None
    # Tiers behind memory (and behind --disk), in order: KIND:TARGET?OPTION=VALUE&...
    tiers: tuple[str, ...] = ()
    # Connections and requests
    max_connections: int = 4096
    max_connections_per_address: int = 1024
    # Timeouts (seconds; docs/operating.md "Limits and timeouts"). 0 turns one off.
    idle_timeout: float = 60.0  # idle connections closed after this, while over 3/4 of max_connections
    header_timeout: float = 10.0  # a request header must complete this soon after its first byte
    body_timeout: float = 30.0  # a body, or replies the peer does not read, without progress this long
    max_list_keys: int = 1_000_000
    memory_wait: float = 5.0  # how long a PUT waits for memory before it is refused
    shutdown_timeout: float = 10.0  # graceful drain bound on SIGTERM/SIGINT
    loop: Loop = "auto"
    # Logging
    log_level: LogLevel = "info"
    log_format: LogFormat = "auto"
    # Operations (docs/operating.md "Access control and TLS", docs/metrics.md)
    allow: tuple[str, ...] = ()  # CIDRs that may connect; empty: everyone
    plain: bool = True  # serve the plain TCP port (False: TLS only)
    tls_port: int | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA
    metrics_port: int | None = None
    metrics_host: str | None = None  # None: same as host

    def __post_init__(self) -> None:
        """Every option's range, checked once at startup: a bad value is one clear error
        (the CLI prints it and exits 2), never a failure later while serving."""
        _check(bool(self.host), "--host", "must not be empty")
        _check(0 <= self.port <= 65535, "--port", f"{self.port} is out of range 0-65535")
        for name, values in CHOICES.items():
            value = getattr(self, name)
            _check(value in values, option(name), f"{value!r} is not one of {', '.join(values)}")
        _size("--memory-limit", self.memory_limit, minimum=1)
        _check(
            1 <= self.max_object_size <= 2**31 - 1,
            "--max-object-size",
            "must be 1 byte to 2GiB - 1 (the protocol's int32 length)",
        )
        _size("--disk-limit", self.disk_limit, minimum=1)
        _size("--write-behind-limit", self.write_behind_limit, minimum=0)
        if self.dirty_limit is not None:
            _size("--dirty-limit", self.dirty_limit, minimum=1)
        _count("--max-connections", self.max_connections, MAX_CONNECTIONS)
        _count("--max-connections-per-address", self.max_connections_per_address, MAX_CONNECTIONS)
        _seconds("--idle-timeout", self.idle_timeout)
        _seconds("--header-timeout", self.header_timeout)
        _seconds("--body-timeout", self.body_timeout)
        _count("--max-list-keys", self.max_list_keys, 2**31 - 1)
        _seconds("--memory-wait", self.memory_wait)
        _seconds("--shutdown-timeout", self.shutdown_timeout)
        if self.max_object_size > self.memory_limit:
            object.__setattr__(self, "max_object_size", self.memory_limit)
        for text in self.tiers:
            try:
                TierSpec.parse(text)  # syntax only; the kind's own options are checked at startup
            except ValueError as exc:
                raise OptionError("--tier", str(exc)) from None
        self._check_operations()

    def _check_operations(self) -> None:
        try:
            parse_networks(self.allow)
        except ValueError as exc:
            raise OptionError("--allow", str(exc)) from None
        if (self.tls_port is None) != (self.tls_cert is None):
            raise OptionError("--tls-port", "--tls-port and --tls-cert go together")
        if self.tls_port is None and (self.tls_key is not None or self.tls_client_ca is not None):
            raise OptionError("--tls-key", "--tls-key and --tls-client-ca need --tls-port and --tls-cert")
        if not self.plain and self.tls_port is None:
            raise OptionError("--no-plain", "--no-plain needs a TLS listener (--tls-port)")
        for option, port in (("--tls-port", self.tls_port), ("--metrics-port", self.metrics_port)):
            if port is not None:
                _check(0 <= port <= 65535, option, f"{port} is out of range 0-65535")


class OptionError(ConfigError):
    """An option's value cannot be used: a configuration or startup error (exit status 2).
    ``option`` names it (``--port``), so the command line can say where the value came from.
    A ``ConfigError`` (a ``ValueError``), as a bad ``--tier`` always was."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(message)
        self.option = option


MAX_CONNECTIONS = 1 << 20
"""Upper bound of the connection counts: Linux's default limit of descriptors per process."""

MAX_SECONDS = 1e9
"""Upper bound of every timeout (~31 years): larger ones overflow event loop timers."""

FIELDS: dict[str, Field[Any]] = {f.name: f for f in fields(ServerConfig)}

CHOICES: dict[str, tuple[str, ...]] = {
    name: get_args(kind) for name, kind in get_type_hints(ServerConfig).items() if get_origin(kind) is Literal
}
"""The values each ``Literal`` field may take: what ``ServerConfig`` accepts and the CLI offers."""


def option(name: str) -> str:
    """The command-line option of field ``name`` (``memory_wait``: ``--memory-wait``); the
    one exception is ``tiers``, given one ``--tier`` at a time."""
    return "--" + name.replace("_", "-")


def default(name: str) -> Any:
    """Field ``name``'s default; None where there is none or it is computed when the config is
    made (``memory_limit``: half of physical memory)."""
    value = FIELDS[name].default
    return None if value is MISSING else value


def _check(ok: bool, option: str, problem: str) -> None:
    if not ok:
        raise OptionError(option, problem if problem.startswith(option) else f"{option} {problem}")


def _size(option: str, value: int, *, minimum: int) -> None:
    _check(
        minimum <= value <= MAX_SIZE,
        option,
        f"must be {'positive' if minimum else 'at least 0'} and at most {format_size(MAX_SIZE)}, not {value}",
    )


def _count(option: str, value: int, maximum: int) -> None:
    _check(1 <= value <= maximum, option, f"must be 1 to {maximum:,}, not {value:,}")


def _seconds(option: str, value: float) -> None:
    _check(
        math.isfinite(value) and 0 <= value <= MAX_SECONDS,
        option,
        f"must be a finite number of seconds from 0 to {MAX_SECONDS:.0e}, not {value}",
    )
