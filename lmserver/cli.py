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
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

from lmproto import REPLY_SIZE, Command, Generation, Status, decode_json, decode_reply, encode_request

from . import __version__, hardexit
from .config import CHOICES, MAX_CONNECTIONS, OptionError, ServerConfig, default
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


ENV_PREFIX = "LMSERVER_"
"""Every serve option also reads the variable ``LMSERVER_<OPTION>`` (``LMSERVER_MEMORY_WAIT``)."""

F = TypeVar("F", bound=Callable[..., Any])


def setting(*decls: str, **attrs: Any) -> Callable[[F], F]:
    """A click option for the ``ServerConfig`` field it sets: the field of the option's name
    (``--memory-wait``: ``memory_wait``), or the name given among ``decls`` as click takes it
    (``"--tier", "tiers"``). Its default (a size shown with its unit), a ``Literal`` field's
    values as its choices, and its variable ``LMSERVER_<OPTION>`` come from there, so that
    each is written once (config.py); ``attrs`` add the help, a type or range, or override."""
    long = next(d for d in decls if d.startswith("--")).split("/")[0].removeprefix("--")
    name = next((d for d in decls if not d.startswith("-")), long.replace("-", "_"))
    if name in CHOICES:
        attrs.setdefault("type", click.Choice(CHOICES[name]))
    if "default" not in attrs:
        value = default(name)
        attrs["default"] = format_size(value) if attrs.get("type") is SIZE and value is not None else value
    env = ENV_PREFIX + long.replace("-", "_").upper()
    return click.option(*decls, envvar=env, show_envvar=True, **attrs)


@click.group(cls=DefaultToServe, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="lmcache-server")
def main() -> None:
    """lmserver: a remote KV-cache server for LMCache's lm:// protocol.

    Without a subcommand, serves (see `lmcache-server serve --help`).
    """


@main.command(context_settings={"show_default": True})
@click.argument("positional", nargs=-1, metavar="[HOST PORT [cpu|PATH]]")
@setting(
    "--host",
    help="Address to bind. 127.0.0.1 keeps the cache private to this host; use 0.0.0.0 to serve a network.",
)
@setting("--port", type=click.IntRange(0, 65535), help="TCP port (0 picks a free one and logs it).")
@setting(
    "--memory-limit",
    type=SIZE,
    help="Bytes of object memory (buffers, and 1 KiB per object for its metadata), never "
    "exceeded; LRU objects are evicted to make room. [default: half of physical memory]",
)
@setting(
    "--max-object-size",
    type=SIZE,
    help="Largest object accepted; larger PUTs are refused without allocating.",
)
@setting(
    "--disk",
    type=click.Path(file_okay=False, path_type=Path),
    help="Directory of the persistent disk tier behind memory.",
)
@setting(
    "--disk-limit",
    type=SIZE,
    help="Bytes the disk tier may use (files and headers); LRU eviction beyond, and below it while"
    " the filesystem is full.",
)
@setting(
    "--fsync",
    help="Disk durability of a stored object (and of a PUT_ACK's answer): never = written, "
    "survives a server crash but maybe not a power loss (a torn record is then dropped by its "
    "checksum, never served); always = fdatasync'ed before it counts as stored; batch = like "
    "always, one fdatasync covering the writes of ~10 ms.",
)
@setting(
    "--disk-direct",
    help="auto = disk writes with direct I/O (O_DIRECT) where the filesystem takes it: objects "
    "above 512 KiB straight from memory to the device, smaller ones combined into 4 MiB writes, "
    "none through the page cache; off = through the page cache.",
)
@setting(
    "--write-behind-limit",
    type=SIZE,
    help="With --disk: bytes of objects waiting for disk writes (write-behind and demotion); past "
    "it (or past --dirty-limit) --write-behind-full decides (PUT_ACK writes are never skipped).",
)
@setting(
    "--write-behind-full",
    help="With --disk, when the disk's queue is full: wait = a connection reads no more PUT bodies "
    "until the disk catches up (up to --memory-wait; GETs on other connections never wait), so "
    "a restart finds everything; skip = the disk write is skipped and counted.",
)
@setting(
    "--dirty-limit",
    type=SIZE,
    help="Bytes of memory that objects waiting for tier writes may hold; past it each tier's "
    "full= policy decides (wait or skip). [default: half of --memory-limit]",
)
@setting(
    "--tier",
    "tiers",
    multiple=True,
    metavar="KIND:TARGET[?OPT=VAL&...]",
    help="A tier behind memory (and behind --disk); repeat for more, in order. Kinds: disk, nixl, hf. "
    "Every kind takes mode=write-behind|demote, queue=SIZE and full=wait|skip; e.g. "
    "'disk:/mnt/hdd?capacity=2TiB&mode=demote'. The env var takes specs separated by spaces.",
)
@setting(
    "--memory-wait",
    type=click.FloatRange(0),
    help="Seconds a PUT (or a disk hit) waits for memory held by objects in flight (sends, disk "
    "writes) before it is refused (PUT_ACK: 507), and for a full=wait tier to catch up before "
    "its write is skipped.",
)
@setting(
    "--max-connections",
    type=click.IntRange(1, MAX_CONNECTIONS),
    help="Connections served at once, TLS handshakes in progress included. At the limit a newcomer "
    "displaces the longest-idle connection of the most crowded address, or is closed on accept when "
    "none is idle.",
)
@setting(
    "--max-connections-per-address",
    type=click.IntRange(1, MAX_CONNECTIONS),
    help="Connections served at once from one client address; more are closed on accept.",
)
@setting(
    "--idle-timeout",
    type=click.FloatRange(0),
    help="Seconds after which an idle connection is closed, while more than 3/4 of "
    "--max-connections are open (0: never).",
)
@setting(
    "--header-timeout",
    type=click.FloatRange(0),
    help="Seconds a request header may take from its first byte to its last (0: no limit).",
)
@setting(
    "--body-timeout",
    type=click.FloatRange(0),
    help="Seconds a request body, or replies the client does not read, may make no progress "
    "before the connection is closed (0: no limit).",
)
@setting("--protocol", help="Frame generation: auto detects it per connection from the first header.")
@setting("--max-list-keys", type=click.IntRange(1, 2**31 - 1), help="Most keys one LIST reply carries.")
@setting(
    "--shutdown-timeout",
    type=click.FloatRange(0),
    help="Seconds SIGTERM/SIGINT waits for in-flight requests.",
)
@setting("--loop", help="Event loop: uvloop when installed (auto), or the standard library's.")
@setting("--log-level")
@setting("--log-format", help="auto: human-readable on a terminal, JSON lines otherwise.")
# -- operations: access control, TLS, metrics, config file (docs/operating.md, docs/metrics.md)
@setting(
    "--allow",
    multiple=True,
    metavar="CIDR",
    help="Only peers in this network (10.0.0.0/8) or with this address may connect, to every port; "
    "repeatable (the variable takes a space- or comma-separated list). Others are closed at accept, "
    "before a TLS handshake. [default: everyone who can reach --host]",
)
@setting("--plain/--no-plain", help="Serve plain TCP on --port; --no-plain serves only the TLS listener.")
@setting(
    "--tls-port",
    type=click.IntRange(0, 65535),
    help="Also serve TLS (lmclient's lms://) on this port, on --host. Needs --tls-cert.",
)
@setting(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM certificate chain of the TLS listener (may hold the key too).",
)
@setting(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="PEM private key of --tls-cert.",
)
@setting(
    "--tls-client-ca",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Require TLS clients to present a certificate signed by this CA (PEM).",
)
@setting(
    "--metrics-port",
    type=click.IntRange(0, 65535),
    help="Serve Prometheus metrics over HTTP at /metrics on this port (on the event loop; --allow "
    "applies; 16 connections at most). [default: off]",
)
@setting("--metrics-host", help="Address the metrics endpoint binds. [default: --host]")
@click.option(
    "--config",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    envvar=ENV_PREFIX + "CONFIG",
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
@setting("--host", show_default=True)
@setting("--port", type=click.IntRange(1, 65535), show_default=True)
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
