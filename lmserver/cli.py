"""The ``lmcache-server`` command line.

    lmcache-server --port 65432 --disk /data          # serve (the default command)
    lmcache-server localhost 65432 cpu                # upstream LMCache's positional form
    lmcache-server health --port 65432                # exit 0 if the server answers HEALTH

Every serve option can also come from an environment variable ``LMSERVER_<OPTION>``.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import click

from lmproto import REPLY_SIZE, Command, Generation, Status, decode_json, decode_reply, encode_request

from . import __version__, hardexit
from .config import (
    DEFAULT_DISK_LIMIT,
    DEFAULT_MAX_OBJECT_SIZE,
    DEFAULT_PORT,
    MAX_CONNECTIONS,
    OptionError,
    ServerConfig,
)
from .configfile import describe, use_config_file
from .sizes import format_size, parse_size


class Size(click.ParamType):  # type: ignore[type-arg]  # generic only in newer click
    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = Size()


class DefaultToServe(click.Group):
    """Runs ``serve`` when the first argument is not a subcommand, so both
    ``lmcache-server --port 1`` and ``lmcache-server HOST PORT cpu`` work."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if not args or (args[0] not in self.commands and args[0] not in ("--help", "-h", "--version")):
            args = ["serve", *args]
        return super().parse_args(ctx, args)


def _env(name: str) -> str:
    return f"LMSERVER_{name}"


@click.group(cls=DefaultToServe, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lmcache-server")
def main() -> None:
    """lmserver: a remote KV-cache server for LMCache's lm:// protocol.

    Without a subcommand, serves (see `lmcache-server serve --help`).
    """


@main.command(context_settings={"show_default": True})
@click.argument("positional", nargs=-1, metavar="[HOST PORT [cpu|PATH]]")
@click.option(
    "--host",
    default="127.0.0.1",
    envvar=_env("HOST"),
    show_envvar=True,
    help="Address to bind. 127.0.0.1 keeps the cache private to this host; use 0.0.0.0 to serve a network.",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    envvar=_env("PORT"),
    show_envvar=True,
    help="TCP port (0 picks a free one and logs it).",
)
@click.option(
    "--memory-limit",
    type=SIZE,
    default=None,
    envvar=_env("MEMORY_LIMIT"),
    show_envvar=True,
    help="Bytes of object memory (buffers, and 1 KiB per object for its metadata), never "
    "exceeded; LRU objects are evicted to make room. [default: half of physical memory]",
)
@click.option(
    "--max-object-size",
    type=SIZE,
    default=format_size(DEFAULT_MAX_OBJECT_SIZE),
    envvar=_env("MAX_OBJECT_SIZE"),
    show_envvar=True,
    help="Largest object accepted; larger PUTs are refused without allocating.",
)
@click.option(
    "--disk",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    envvar=_env("DISK"),
    show_envvar=True,
    help="Directory of the persistent disk tier behind memory.",
)
@click.option(
    "--disk-limit",
    type=SIZE,
    default=format_size(DEFAULT_DISK_LIMIT),
    envvar=_env("DISK_LIMIT"),
    show_envvar=True,
    help="Bytes the disk tier may use (files and headers); LRU eviction beyond, and below it while"
    " the filesystem is full.",
)
@click.option(
    "--fsync",
    type=click.Choice(["always", "batch", "never"]),
    default="never",
    envvar=_env("FSYNC"),
    show_envvar=True,
    help="Disk durability of a stored object (and of a PUT_ACK's answer): never = written, "
    "survives a server crash but maybe not a power loss (a torn record is then dropped by its "
    "checksum, never served); always = fdatasync'ed before it counts as stored; batch = like "
    "always, one fdatasync covering the writes of ~10 ms.",
)
@click.option(
    "--disk-direct",
    type=click.Choice(["auto", "off"]),
    default="auto",
    envvar=_env("DISK_DIRECT"),
    show_envvar=True,
    help="auto = disk writes with direct I/O (O_DIRECT) where the filesystem takes it: objects "
    "above 512 KiB straight from memory to the device, smaller ones combined into 4 MiB writes, "
    "none through the page cache; off = through the page cache.",
)
@click.option(
    "--write-behind-limit",
    type=SIZE,
    default="256MiB",
    envvar=_env("WRITE_BEHIND_LIMIT"),
    show_envvar=True,
    help="With --disk: bytes of objects waiting for disk writes (write-behind and demotion); past "
    "it (or past --dirty-limit) --write-behind-full decides (PUT_ACK writes are never skipped).",
)
@click.option(
    "--write-behind-full",
    type=click.Choice(["wait", "skip"]),
    default="wait",
    envvar=_env("WRITE_BEHIND_FULL"),
    show_envvar=True,
    help="With --disk, when the disk's queue is full: wait = a connection reads no more PUT bodies "
    "until the disk catches up (up to --memory-wait; GETs on other connections never wait), so "
    "a restart finds everything; skip = the disk write is skipped and counted.",
)
@click.option(
    "--dirty-limit",
    type=SIZE,
    default=None,
    envvar=_env("DIRTY_LIMIT"),
    show_envvar=True,
    help="Bytes of memory that objects waiting for tier writes may hold; past it each tier's "
    "full= policy decides (wait or skip). [default: half of --memory-limit]",
)
@click.option(
    "--tier",
    "tiers",
    multiple=True,
    metavar="KIND:TARGET[?OPT=VAL&...]",
    envvar=_env("TIER"),
    show_envvar=True,
    help="A tier behind memory (and behind --disk); repeat for more, in order. Kinds: disk, nixl, hf. "
    "Every kind takes mode=write-behind|demote, queue=SIZE and full=wait|skip; e.g. "
    "'disk:/mnt/hdd?capacity=2TiB&mode=demote'. The env var takes specs separated by spaces.",
)
@click.option(
    "--memory-wait",
    "put_wait_timeout",
    type=click.FloatRange(0),
    default=5.0,
    envvar=_env("MEMORY_WAIT"),
    show_envvar=True,
    help="Seconds a PUT (or a disk hit) waits for memory held by objects in flight (sends, disk "
    "writes) before it is refused (PUT_ACK: 507), and for a full=wait tier to catch up before "
    "its write is skipped.",
)
@click.option(
    "--max-connections",
    type=click.IntRange(1, MAX_CONNECTIONS),
    default=4096,
    envvar=_env("MAX_CONNECTIONS"),
    show_envvar=True,
    help="Connections served at once, TLS handshakes in progress included. At the limit a newcomer "
    "displaces the longest-idle connection of the most crowded address, or is closed on accept when "
    "none is idle.",
)
@click.option(
    "--max-connections-per-address",
    type=click.IntRange(1, MAX_CONNECTIONS),
    default=1024,
    envvar=_env("MAX_CONNECTIONS_PER_ADDRESS"),
    show_envvar=True,
    help="Connections served at once from one client address; more are closed on accept.",
)
@click.option(
    "--idle-timeout",
    type=click.FloatRange(0),
    default=60.0,
    envvar=_env("IDLE_TIMEOUT"),
    show_envvar=True,
    help="Seconds after which an idle connection is closed, while more than 3/4 of "
    "--max-connections are open (0: never).",
)
@click.option(
    "--header-timeout",
    type=click.FloatRange(0),
    default=10.0,
    envvar=_env("HEADER_TIMEOUT"),
    show_envvar=True,
    help="Seconds a request header may take from its first byte to its last (0: no limit).",
)
@click.option(
    "--body-timeout",
    type=click.FloatRange(0),
    default=30.0,
    envvar=_env("BODY_TIMEOUT"),
    show_envvar=True,
    help="Seconds a request body, or replies the client does not read, may make no progress "
    "before the connection is closed (0: no limit).",
)
@click.option(
    "--protocol",
    type=click.Choice(["auto", "v0", "v1"]),
    default="auto",
    envvar=_env("PROTOCOL"),
    show_envvar=True,
    help="Frame generation: auto detects it per connection from the first header.",
)
@click.option(
    "--max-list-keys",
    type=click.IntRange(1, 2**31 - 1),
    default=1_000_000,
    envvar=_env("MAX_LIST_KEYS"),
    show_envvar=True,
    help="Most keys one LIST reply carries.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(0),
    default=10.0,
    envvar=_env("SHUTDOWN_TIMEOUT"),
    show_envvar=True,
    help="Seconds SIGTERM/SIGINT waits for in-flight requests.",
)
@click.option(
    "--loop",
    type=click.Choice(["auto", "uvloop", "asyncio"]),
    default="auto",
    envvar=_env("LOOP"),
    show_envvar=True,
    help="Event loop: uvloop when installed (auto), or the standard library's.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    envvar=_env("LOG_LEVEL"),
    show_envvar=True,
)
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    default="auto",
    envvar=_env("LOG_FORMAT"),
    show_envvar=True,
    help="auto: human-readable on a terminal, JSON lines otherwise.",
)
# -- operations: access control, TLS, metrics, config file (README "Metrics", "Access control
# and TLS", "Configuration file") ------------------------------------------------------------
@click.option(
    "--allow",
    multiple=True,
    metavar="CIDR",
    envvar=_env("ALLOW"),
    show_envvar=True,
    help="Only peers in this network (10.0.0.0/8) or with this address may connect, to every port; "
    "repeatable (the variable takes a space- or comma-separated list). Others are closed at accept, "
    "before a TLS handshake. [default: everyone who can reach --host]",
)
@click.option(
    "--plain/--no-plain",
    default=True,
    envvar=_env("PLAIN"),
    show_envvar=True,
    help="Serve plain TCP on --port; --no-plain serves only the TLS listener.",
)
@click.option(
    "--tls-port",
    type=click.IntRange(0, 65535),
    default=None,
    envvar=_env("TLS_PORT"),
    show_envvar=True,
    help="Also serve TLS (lmclient's lms://) on this port, on --host. Needs --tls-cert.",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    envvar=_env("TLS_CERT"),
    show_envvar=True,
    help="PEM certificate chain of the TLS listener (may hold the key too).",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    envvar=_env("TLS_KEY"),
    show_envvar=True,
    help="PEM private key of --tls-cert.",
)
@click.option(
    "--tls-client-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    default=None,
    envvar=_env("TLS_CLIENT_CA"),
    show_envvar=True,
    help="Require TLS clients to present a certificate signed by this CA (PEM).",
)
@click.option(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    default=None,
    envvar=_env("METRICS_PORT"),
    show_envvar=True,
    help="Serve Prometheus metrics over HTTP at /metrics on this port (on the event loop; --allow "
    "applies; 16 connections at most). [default: off]",
)
@click.option(
    "--metrics-host",
    default=None,
    envvar=_env("METRICS_HOST"),
    show_envvar=True,
    help="Address the metrics endpoint binds. [default: --host]",
)
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar=_env("CONFIG"),
    show_envvar=True,
    is_eager=True,
    expose_value=False,
    callback=use_config_file,
    help="TOML file of serve options (keys: option names); the command line and LMSERVER_* "
    "variables override it.",
)
def serve(positional: tuple[str, ...], **options: Any) -> None:
    """Serve the lm:// protocol (both frame generations) until SIGTERM or SIGINT."""
    from .server import run

    if positional:
        if len(positional) not in (2, 3):
            raise click.UsageError("the positional form is: HOST PORT [cpu|PATH]")
        options["host"] = positional[0]
        try:
            options["port"] = int(positional[1])
        except ValueError:
            raise click.UsageError(f"PORT must be a number, not {positional[1]!r}") from None
        if len(positional) == 3 and positional[2] != "cpu":
            options["disk"] = Path(positional[2])
    for name in ("memory_limit", "dirty_limit"):
        if options[name] is None:
            del options[name]
    ctx = click.get_current_context()
    try:
        config = ServerConfig(**options)
    except OptionError as exc:
        raise click.UsageError(describe(ctx, exc)) from None
    status = run(config, lambda exc: describe(ctx, exc))
    hardexit.set_exit_code(status)  # honoured if a native library forces a hard exit
    sys.exit(status)


@main.command()
@click.option("--host", default="127.0.0.1", envvar=_env("HOST"), show_default=True)
@click.option(
    "--port", type=click.IntRange(1, 65535), default=DEFAULT_PORT, envvar=_env("PORT"), show_default=True
)
@click.option("--timeout", type=click.FloatRange(0), default=3.0, show_default=True)
@click.option("--stats", "show_stats", is_flag=True, help="Also print the server's STATS as JSON.")
def health(host: str, port: int, timeout: float, show_stats: bool) -> None:
    """Ask a running server for HEALTH over the protocol; exit 0 if healthy, 1 if not."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            status, _ = _ask(sock, Command.HEALTH)
            if show_stats:
                _, body = _ask(sock, Command.STATS)
                click.echo(json.dumps(decode_json(body), indent=2, sort_keys=True))
    except OSError as exc:
        click.echo(f"unhealthy: {host}:{port}: {exc}", err=True)
        sys.exit(1)
    if status != Status.SUCCESS:
        click.echo(f"unhealthy: {host}:{port} answered {status}", err=True)
        sys.exit(1)
    click.echo(f"healthy: {host}:{port}")


def _ask(sock: socket.socket, command: Command) -> tuple[int, bytes]:
    sock.sendall(encode_request(command, generation=Generation.V0))
    header = _recv_exactly(sock, REPLY_SIZE[Generation.V0])
    reply = decode_reply(header, Generation.V0)
    return reply.status, _recv_exactly(sock, reply.length)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise ConnectionError("server closed the connection")
        got += k
    return bytes(buf)
