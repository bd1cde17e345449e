"""Server configuration: one frozen dataclass, filled by the CLI or by tests directly."""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from .access import parse_networks
from .tiers.spec import TierSpec

DEFAULT_PORT = 65432
DEFAULT_MAX_OBJECT_SIZE = 512 * 1024**2
DEFAULT_DISK_LIMIT = 64 * 1024**3


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
    # Frames: "auto" decides per connection from the first header.
    protocol: Literal["auto", "v0", "v1"] = "auto"
    # Memory tier
    memory_limit: int = field(default_factory=default_memory_limit)
    max_object_size: int = DEFAULT_MAX_OBJECT_SIZE
    # Disk tier (None: memory only)
    disk: Path | None = None
    disk_limit: int = DEFAULT_DISK_LIMIT
    fsync: Literal["always", "batch", "never"] = "never"
    disk_direct: Literal["auto", "off"] = "auto"  # O_DIRECT writes of large objects
    # Bytes of objects queued for the disk tier's writes (write-behind and demotion); past
    # it write_behind_full decides: wait (throttle the PUT's connection) or skip (count).
    write_behind_limit: int = 256 * 1024**2
    write_behind_full: Literal["wait", "skip"] = "wait"
    # Memory objects waiting for tier writes may hold (None: half of memory_limit).
    dirty_limit: int | None = None
    # Tiers behind memory (and behind --disk), in order: KIND:TARGET?OPTION=VALUE&...
    tiers: tuple[str, ...] = ()
    # Connections and requests
    max_connections: int = 4096
    max_connections_per_address: int = 1024
    # Timeouts (seconds; README "Limits and timeouts"). 0 turns one off.
    idle_timeout: float = 60.0  # idle connections closed after this, while over 3/4 of max_connections
    header_timeout: float = 10.0  # a request header must complete this soon after its first byte
    body_timeout: float = 30.0  # a body, or replies the peer does not read, without progress this long
    max_list_keys: int = 1_000_000
    put_wait_timeout: float = 5.0  # how long a PUT waits for memory before it is refused
    shutdown_timeout: float = 10.0  # graceful drain bound on SIGTERM/SIGINT
    loop: Literal["auto", "uvloop", "asyncio"] = "auto"
    # Logging
    log_level: str = "info"
    log_format: Literal["auto", "console", "json"] = "auto"
    # Operations (docs: README "Metrics", "Access control and TLS")
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
        _check(bool(self.host), "--host must not be empty")
        _check(0 <= self.port <= 65535, f"--port {self.port} is out of range 0-65535")
        _choice("--protocol", self.protocol, ("auto", "v0", "v1"))
        _check(self.memory_limit > 0, "--memory-limit must be positive")
        _check(
            1 <= self.max_object_size <= 2**31 - 1,
            "--max-object-size must be 1 byte to 2GiB - 1 (the protocol's int32 length)",
        )
        _check(self.disk_limit > 0, "--disk-limit must be positive")
        _choice("--fsync", self.fsync, ("always", "batch", "never"))
        _choice("--disk-direct", self.disk_direct, ("auto", "off"))
        _check(self.write_behind_limit >= 0, "--write-behind-limit must not be negative")
        _choice("--write-behind-full", self.write_behind_full, ("wait", "skip"))
        _check(self.dirty_limit is None or self.dirty_limit > 0, "--dirty-limit must be positive")
        _check(self.max_connections >= 1, "--max-connections must be at least 1")
        _check(self.max_connections_per_address >= 1, "--max-connections-per-address must be at least 1")
        _seconds("--idle-timeout", self.idle_timeout)
        _seconds("--header-timeout", self.header_timeout)
        _seconds("--body-timeout", self.body_timeout)
        _check(self.max_list_keys >= 1, "--max-list-keys must be at least 1")
        _seconds("--memory-wait", self.put_wait_timeout)
        _seconds("--shutdown-timeout", self.shutdown_timeout)
        _choice("--loop", self.loop, ("auto", "uvloop", "asyncio"))
        _check(
            self.log_level.upper() in logging.getLevelNamesMapping(),
            f"--log-level {self.log_level!r} is not a log level",
        )
        _choice("--log-format", self.log_format, ("auto", "console", "json"))
        if self.max_object_size > self.memory_limit:
            object.__setattr__(self, "max_object_size", self.memory_limit)
        for text in self.tiers:
            TierSpec.parse(text)  # syntax only; the kind's own options are checked at startup
        self._check_operations()

    def _check_operations(self) -> None:
        parse_networks(self.allow)  # raises ValueError naming a bad entry
        if (self.tls_port is None) != (self.tls_cert is None):
            raise ValueError("--tls-port and --tls-cert go together")
        if self.tls_port is None and (self.tls_key is not None or self.tls_client_ca is not None):
            raise ValueError("--tls-key and --tls-client-ca need --tls-port and --tls-cert")
        if not self.plain and self.tls_port is None:
            raise ValueError("--no-plain needs a TLS listener (--tls-port)")
        for port in (self.tls_port, self.metrics_port):
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"port {port} out of range")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _choice(option: str, value: str, choices: tuple[str, ...]) -> None:
    _check(value in choices, f"{option} {value!r} is not one of {', '.join(choices)}")


def _seconds(option: str, value: float) -> None:
    _check(
        math.isfinite(value) and value >= 0, f"{option} must be a finite number of seconds >= 0, not {value}"
    )
