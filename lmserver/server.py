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
import threading
from typing import TYPE_CHECKING, Any

import structlog

from . import __version__
from .access import AccessList
from .config import ServerConfig
from .connection import LMProtocol, sweep
from .logs import configure_logging
from .memory import MemoryTier
from .plain import PlainListener, create_plain_server
from .sizes import format_size
from .state import ServerState
from .stats import log_periodically, native_modules, seconds_since_start, trim_idle_memory
from .store import Store
from .tiers.base import ConfigError, Tier
from .tiers.spec import ChainOptions, TierSpec
from .tls import HANDSHAKE_TIMEOUT_S, server_context

if TYPE_CHECKING:
    from .metrics import MetricsServer

log = structlog.get_logger("lmserver.server")


def build_tiers(config: ServerConfig) -> list[tuple[Tier, ChainOptions]]:
    """The tiers behind memory, in order: ``--disk`` first, then each ``--tier``.
    Raises ConfigError (a startup error) for a bad spec or a missing backend."""
    from .tiers import registry

    tiers: list[tuple[Tier, ChainOptions]] = []
    if config.disk is not None:
        from .tiers.disk import DiskTier

        disk = DiskTier(
            config.disk, capacity=config.disk_limit, fsync=config.fsync, direct=config.disk_direct
        )
        options = ChainOptions(
            mode=disk.default_mode, queue_bytes=config.write_behind_limit, full=config.write_behind_full
        )
        tiers.append((disk, options))
    for text in config.tiers:
        tiers.append(registry.build(TierSpec.parse(text)))
    return tiers


class Server:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        store = Store(
            MemoryTier(config.memory_limit),
            build_tiers(config),
            memory_wait=config.put_wait_timeout,
            dirty_limit=config.dirty_limit,
        )
        self.state = ServerState(config=config, store=store, access=AccessList(config.allow))
        self._server: PlainListener | None = None  # the plain listener (plain.py)
        self._listeners: list[asyncio.Server | PlainListener] = []  # the plain and the TLS one
        self._metrics: MetricsServer | None = None
        self._stop = asyncio.Event()
        self._background: list[asyncio.Task[None]] = []
        self.host = config.host
        self.port = config.port
        self.tls_port: int | None = None
        self.metrics_port: int | None = None

    async def start(self) -> None:
        raise_fd_limit()
        await self.state.store.open()
        loop = asyncio.get_running_loop()
        if self.config.plain:
            self._server = await create_plain_server(
                lambda: LMProtocol(self.state), self.config.host, self.config.port, backlog=1024
            )
            self._listeners.append(self._server)
            sockname = self._server.sockets[0].getsockname()
            self.host, self.port = sockname[0], sockname[1]
        await self._start_operations(loop)
        self._background.append(loop.create_task(log_periodically(self.state)))
        self._background.append(loop.create_task(trim_idle_memory(self.state)))
        self._background.append(loop.create_task(sweep(self.state)))
        log.info(
            "listening",
            host=self.host,
            port=self.port if self.config.plain else None,
            version=__version__,
            compiled=native_modules(),
            loop=type(loop).__module__.split(".")[0],
            protocol=self.config.protocol,
            memory_limit=format_size(self.config.memory_limit),
            max_object_size=format_size(self.config.max_object_size),
            max_connections=self.config.max_connections,
            disk=str(self.config.disk) if self.config.disk else None,
            disk_limit=format_size(self.config.disk_limit) if self.config.disk else None,
            fsync=self.config.fsync if self.config.disk else None,
            plain=self.config.plain,
            tls_port=self.tls_port,
            metrics_port=self.metrics_port,
            allow=list(self.config.allow) or None,
            startup_s=seconds_since_start(),
        )

    async def _start_operations(self, loop: asyncio.AbstractEventLoop) -> None:
        """The TLS listener and the metrics endpoint, when configured."""
        config = self.config
        if config.tls_port is not None:
            assert config.tls_cert is not None
            tls = await loop.create_server(
                lambda: LMProtocol(self.state),
                config.host,
                config.tls_port,
                ssl=server_context(config.tls_cert, config.tls_key, config.tls_client_ca),
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
                backlog=1024,
                reuse_address=True,
            )
            self._listeners.append(tls)
            self.tls_port = tls.sockets[0].getsockname()[1]
        if config.metrics_port is not None:
            from .metrics import LatencyRecorder, MetricsServer

            self.state.latency = LatencyRecorder()
            self._metrics = MetricsServer(self.state, loop)
            self._metrics.start(config.metrics_host or config.host, config.metrics_port)
            self.metrics_port = self._metrics.port

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        """Start, serve until ``request_stop``, then shut down gracefully."""
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def shutdown(self) -> None:
        state = self.state
        state.shutting_down = True
        for listener in self._listeners:
            listener.close()
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
        await self.state.store.close(flush_s=self.config.shutdown_timeout)
        for listener in self._listeners:
            await listener.wait_closed()
        if self._metrics is not None:
            self._metrics.stop()
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
    return asyncio.new_event_loop()


def run(config: ServerConfig) -> int:
    """Run a server in this thread until SIGTERM/SIGINT; returns the exit status."""
    configure_logging(config.log_level, config.log_format)
    try:
        server = Server(config)
    except ConfigError as exc:  # a bad --tier or a missing backend package
        log.error("cannot start", error=str(exc))
        return 2
    loop = new_event_loop(config.loop)
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

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    try:
        loop.run_until_complete(server.serve())
    except (OSError, RuntimeError) as exc:  # port taken, disk folder in use or unusable
        log.error("cannot start", error=str(exc))
        return 1
    finally:
        loop.close()
    return 0


class ServerThread:
    """A server on its own event loop in a background thread (tests, embedding)."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.server: Server | None = None
        self._loop = new_event_loop(config.loop)
        self._thread = threading.Thread(target=self._run, name="lmserver", daemon=True)
        self._started = threading.Event()
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self.server = Server(self.config)
        try:
            self._loop.run_until_complete(self.server.start())
        except BaseException as exc:
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self._loop.run_until_complete(self.server._stop.wait())
        self._loop.run_until_complete(self.server.shutdown())
        self._loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    @property
    def host(self) -> str:
        assert self.server is not None
        return self.server.host

    @property
    def port(self) -> int:
        assert self.server is not None
        return self.server.port

    @property
    def tls_port(self) -> int | None:
        assert self.server is not None
        return self.server.tls_port

    @property
    def metrics_port(self) -> int | None:
        assert self.server is not None
        return self.server.metrics_port

    def call(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(*args)`` on the server's loop and return its result (for inspection)."""

        async def _call() -> Any:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(_call(), self._loop).result(10)

    def stop(self) -> None:
        if self._thread.is_alive() and self.server is not None:
            self._loop.call_soon_threadsafe(self.server.request_stop)
            self._thread.join(self.config.shutdown_timeout + 10)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
