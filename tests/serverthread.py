"""``ServerThread``: an lmserver on its own event loop in a background thread of the test
process, so a test can inspect the server's state (``call``) while it serves. Tests that need
signals, SIGKILL or restarts use a subprocess instead (``serverproc.ServerProcess``)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from lmserver.config import ServerConfig
from lmserver.server import Server, new_event_loop


class ServerThread:
    """A server on its own event loop in a background thread, to drive and inspect in process."""

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
        self._loop.run_until_complete(self.server.serve_started())
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
