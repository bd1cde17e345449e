"""The server: binds, accepts connections, and shuts down gracefully.

Shutdown order (as uvicorn does it): stop accepting, ask every connection to finish the
request it is on and close, wait up to ``shutdown_timeout`` for them, abort the rest, wait
for the store's pending writes, close the tiers.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import signal
import socket
import ssl
import traceback
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import structlog

from . import __version__
from .access import AccessList
from .admission import Admission, address_of
from .config import OptionError, ServerConfig
from .connection import LMProtocol, sweep
from .logs import configure_logging
from .plain import PlainListener, PlainTransport, listen
from .sizes import format_size
from .state import ServerState
from .stats import log_periodically, native_modules, seconds_since_start, trim_idle_memory
from .storage.memory import MemoryTier
from .storage.store import Store
from .storage.tiers.base import ConfigError, Tier
from .storage.tiers.spec import ChainOptions, TierSpec
from .tls import StdlibLoop, server_context

if TYPE_CHECKING:
    from .metrics_endpoint import MetricsEndpoint

log = structlog.get_logger("lmserver.server")


def build_tiers(config: ServerConfig) -> list[tuple[Tier, ChainOptions, str]]:
    """The tiers behind memory, in order: ``--disk`` first, then each ``--tier``, each with
    the option that configured it. Raises OptionError for a bad spec or a missing backend."""
    from .storage.tiers import registry

    tiers: list[tuple[Tier, ChainOptions, str]] = []
    if config.disk is not None:
        from .storage.tiers.disk import DiskTier

        disk = DiskTier(
            config.disk, capacity=config.disk_limit, fsync=config.fsync, direct=config.disk_direct
        )
        options = ChainOptions(
            mode=disk.default_mode, queue_bytes=config.write_behind_limit, full=config.write_behind_full
        )
        tiers.append((disk, options, f"--disk {config.disk}"))
    for text in config.tiers:
        spec = TierSpec.parse(text)
        try:
            tiers.append((*registry.build(spec), f"--tier {spec}"))
        except ConfigError as exc:  # "tier SPEC: what is wrong", or what a backend said
            raise OptionError("--tier", f"--tier {spec}: {str(exc).removeprefix(f'tier {spec}: ')}") from None
    return tiers


@contextlib.contextmanager
def startup_step(option: str) -> Iterator[None]:
    """What fails inside is a startup error naming ``option`` (exit status 2), one line."""
    try:
        yield
    except OptionError:
        raise
    except Exception as exc:
        raise OptionError(option.split()[0], f"{option}: {exc}") from exc


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        tiers = build_tiers(config)
        self._tier_options = {id(tier): option for tier, _, option in tiers}
        store = Store(
            MemoryTier(config.memory_limit),
            [(tier, options) for tier, options, _ in tiers],
            memory_wait=config.memory_wait,
            dirty_limit=config.dirty_limit,
        )
        self.state = ServerState(config=config, store=store, access=AccessList(config.allow))
        self.admission = Admission(self.state)
        self._server: PlainListener | None = None  # the plain listener (plain.py)
        self._listeners: list[PlainListener] = []  # the plain and the TLS one
        self._metrics: MetricsEndpoint | None = None
        self._tls: ssl.SSLContext | None = None
        self._stop = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self.host = config.host
        self.port = config.port
        self.tls_port: int | None = None
        self.metrics_port: int | None = None

    async def start(self) -> None:
        """Open the tiers, then listen: metrics first, so that once the lm:// port answers,
        so does /metrics. A failure is an OptionError naming the option at fault."""
        config = self.config
        raise_fd_limit()
        if config.tls_cert is not None:
            with startup_step(f"--tls-cert {config.tls_cert}"):
                self._tls = server_context(config.tls_cert, config.tls_key, config.tls_client_ca)
        await self._open_tiers()
        try:
            await self._listen()
        except BaseException:
            await self.shutdown()
            raise
        loop = asyncio.get_running_loop()
        self._background.append(loop.create_task(log_periodically(self.state)))
        self._background.append(loop.create_task(trim_idle_memory(self.state)))
        self._background.append(loop.create_task(sweep(self.state)))
        log.info(
            "listening",
            host=self.host,
            port=self.port if config.plain else None,
            version=__version__,
            compiled=native_modules(),
            loop=type(loop).__module__.split(".")[0],
            protocol=config.protocol,
            memory_limit=format_size(config.memory_limit),
            max_object_size=format_size(config.max_object_size),
            max_connections=config.max_connections,
            disk=str(config.disk) if config.disk else None,
            disk_limit=format_size(config.disk_limit) if config.disk else None,
            fsync=config.fsync if config.disk else None,
            plain=config.plain,
            tls_port=self.tls_port,
            metrics_port=self.metrics_port,
            allow=list(config.allow) or None,
            startup_s=seconds_since_start(),
        )

    async def _open_tiers(self) -> None:
        try:
            await self.state.store.open()
        except Exception as exc:
            option = self._failed_tier_option(exc)
            message = str(exc) or type(exc).__name__
            raise OptionError(option.split()[0], f"{option}: cannot open the tier: {message}") from exc

    def _failed_tier_option(self, exc: BaseException) -> str:
        """The option of the tier whose code raised ``exc``. The Store opens the tiers one
        after another; the innermost frame that belongs to a tier (its ``open``, or a worker
        thread's function) tells which."""
        failed = None
        for frame, _ in traceback.walk_tb(exc.__traceback__):
            owner = frame.f_locals.get("self")
            if id(owner) in self._tier_options:
                failed = self._tier_options[id(owner)]
        if failed is None and len(self._tier_options) == 1:
            failed = next(iter(self._tier_options.values()))
        return failed or "--tier"

    async def _listen(self) -> None:
        config = self.config
        if config.metrics_port is not None:
            from .metrics import LatencyRecorder, registry
            from .metrics_endpoint import MetricsEndpoint

            self.state.latency = LatencyRecorder()
            self._metrics = MetricsEndpoint(self.state, registry(self.state))
            with startup_step(f"--metrics-port {config.metrics_port}"):
                await self._metrics.start(config.metrics_host or config.host, config.metrics_port)
            self.metrics_port = self._metrics.port
        if config.plain:
            with startup_step(f"--port {config.port}"):
                self._server = await listen(config.host, config.port, self._accept_plain, backlog=1024)
            self._listeners.append(self._server)
            self.host, self.port = self._server.sockets[0].getsockname()[:2]
        if self._tls is not None:
            assert config.tls_port is not None
            with startup_step(f"--tls-port {config.tls_port}"):
                tls = await listen(config.host, config.tls_port, self._accept_tls, backlog=1024)
            self._listeners.append(tls)
            self.tls_port = tls.sockets[0].getsockname()[1]

    def _accept_plain(self, sock: socket.socket, peername: Any) -> None:
        if not self.admission.admit(peername):
            sock.close()
            return
        address = address_of(peername)
        try:
            transport = PlainTransport(
                asyncio.get_running_loop(), sock, peername, LMProtocol(self.state, address)
            )
        except BaseException:
            self.state.release_address(address)
            raise
        transport.start()

    def _accept_tls(self, sock: socket.socket, peername: Any) -> None:
        if not self.admission.admit(peername):
            sock.close()
            return
        assert self._tls is not None
        self.admission.handshake(sock, peername, self._tls, LMProtocol(self.state))

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Start, serve until ``request_stop``, then shut down gracefully."""
        await self.start()
        await self.serve_started()

    async def serve_started(self) -> None:
        """Serve (after ``start``) until ``request_stop``, then shut down gracefully."""
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        state = self.state
        state.shutting_down = True
        for listener in self._listeners:
            listener.close()
        await self.admission.close()
        for connection in list(state.connections):
            connection.shutdown()
        if state.connections:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.no_connections.wait(), self.config.shutdown_timeout)
        if state.connections:
            log.warning("aborting connections after the shutdown timeout", connections=len(state.connections))
            for connection in list(state.connections):
                if connection.transport is not None:
                    connection.transport.abort()
        if state.tasks:
            await asyncio.wait(list(state.tasks), timeout=self.config.shutdown_timeout)
        for task in self._background:
            task.cancel()
        if self._metrics is not None:
            await self._metrics.close()
        await self.state.store.close(flush_s=self.config.shutdown_timeout)
        log.info("stopped", counters=dict(state.current_counters()))


def raise_fd_limit() -> None:
    """Each connection is a file descriptor: lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def new_event_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return StdlibLoop()  # the standard library's, with a shared TLS read buffer (tls.py)


def run(config: ServerConfig, describe: Callable[[OptionError], str] = str) -> int:
    """Run a server in this thread until SIGTERM/SIGINT; returns the exit status: 2 when it
    cannot start (one log line, the option at fault told by ``describe``), else 0."""
    configure_logging(config.log_level, config.log_format)
    loop = new_event_loop(config.loop)
    try:
        server = Server(config)
    except OptionError as exc:  # a bad --tier, or a backend that is not installed
        loop.close()
        log.error("cannot start", error=describe(exc))
        return 2
    signals = 0

    def on_signal(signum: int) -> None:
        nonlocal signals
        signals += 1
        if signals == 1:
            server.request_stop()  # first: nothing (a failing log write included) may prevent it
            log.info("stopping", signal=signal.Signals(signum).name, timeout_s=config.shutdown_timeout)
        else:
            log.warning("second signal: exiting now")
            raise SystemExit(1)

    async def serve() -> int:
        try:
            await server.start()
        except OptionError as exc:
            log.error("cannot start", error=describe(exc))
            return 2
        await server.serve_started()
        return 0

    # Before the "listening" line, and in one run of the loop: a supervisor may signal the
    # moment it reads that line, and uvloop drops a signal that comes between two runs.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        return loop.run_until_complete(serve())
    finally:
        loop.close()
