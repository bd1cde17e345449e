"""An lmserver fleet on a namespace network (``netfleet.Network``): the shared tier's storage
on the switch host (moto's S3 server, reached through the NIXL OBJ tier; or the fake Hub,
through the HF Buckets tier), lmserver processes on hosts, every one configured with the same
shared tier, and a client host whose thread runs the caller's code."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from serverproc import ServerProcess

from . import SWITCH_ADDRESS, Host, Network

T = TypeVar("T")
Kind = Literal["s3", "hf"]
SERVER_PORT = 65432
MOTO_PORT = 9000
HUB_PORT = 9001
S3_BUCKET = "fleet"
HF_BUCKET = "lmtest/fleet"
TESTS = Path(__file__).resolve().parents[1]


class Fleet:
    def __init__(
        self,
        root: Path,
        kind: Kind,
        *,
        hosts: int,
        refresh: float = 1.0,
        memory: str = "64MiB",
        server_args: tuple[str, ...] = (),
    ) -> None:
        self.root = root
        self.kind = kind
        self.refresh = refresh
        self.memory = memory
        self.server_args = server_args
        self.net = Network()
        self.servers: dict[str, ServerProcess] = {}
        try:
            self.client_host = self.net.add("client")
            self.hosts = {f"h{n}": self.net.add(f"h{n}") for n in range(1, hosts + 1)}
            self.client = self.net.thread(self.client_host)
            self._storage = self._start_storage()
        except BaseException:
            self.close()
            raise

    # -- the shared tier ---------------------------------------------------------------------

    def _start_storage(self) -> subprocess.Popen[str]:
        if self.kind == "s3":
            argv = [sys.executable, "-m", "moto.server", "-H", SWITCH_ADDRESS, "-p", str(MOTO_PORT)]
            proc = self.net.popen(self.net.switch, argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            on_switch = self.net.thread(self.net.switch)
            on_switch.submit(_create_s3_bucket, proc).result()
            on_switch.shutdown()
            return proc
        argv = [sys.executable, "-m", "fakehub", str(self.root / "hub"), HF_BUCKET]
        argv += ["--host", SWITCH_ADDRESS, "--port", str(HUB_PORT)]
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        proc = self.net.popen(
            self.net.switch, argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True
        )
        assert proc.stdout is not None
        if not proc.stdout.readline().startswith("http://"):
            raise RuntimeError("the fake Hub did not start")
        return proc

    def spec(self, mode: str = "write-behind") -> str:
        """The ``--tier`` every server of the fleet gets: the shared tier, written behind (a
        fleet's setting; ``demote`` leaves it to what memory evicts)."""
        if self.kind == "s3":
            return (
                f"nixl:s3://{S3_BUCKET}/kv?endpoint=http://{SWITCH_ADDRESS}:{MOTO_PORT}"
                f"&access_key=test&secret_key=test&capacity=1GiB&shared=true&mode={mode}"
                f"&refresh={self.refresh}&timeout=10"
            )
        from fakehub import TOKEN

        return (
            f"hf://buckets/{HF_BUCKET}/kv?endpoint=http://{SWITCH_ADDRESS}:{HUB_PORT}&token={TOKEN}"
            f"&mode={mode}&window=0.01&refresh={self.refresh}&timeout=10"
        )

    def _env(self, name: str) -> dict[str, str]:
        env = {"NIXL_LOG_LEVEL": "WARN", "HF_HUB_DISABLE_TELEMETRY": "1"}
        if self.kind == "hf":
            env["HF_HOME"] = str(self.root / f"hfhome-{name}")
            env["HF_XET_CLIENT_RETRY_MAX_ATTEMPTS"] = "2"
            env["HF_XET_CLIENT_RETRY_BASE_DELAY"] = "10ms"
        return env

    # -- servers ----------------------------------------------------------------------------

    def address(self, name: str) -> str:
        return f"{self.hosts[name].address}:{SERVER_PORT}"

    def start(self, *names: str, mode: str = "write-behind") -> None:
        """Start a server on each named host, at once; returns when all listen."""
        with concurrent.futures.ThreadPoolExecutor(len(names)) as pool:
            started = list(pool.map(lambda name: self._server(name, mode), names))
        self.servers.update(zip(names, started, strict=True))

    def stop(self, *names: str) -> None:
        for name in names:
            self.servers.pop(name).stop()

    def _server(self, name: str, mode: str) -> ServerProcess:
        host = self.hosts[name]
        args = ("--memory-limit", self.memory, "--tier", self.spec(mode), *self.server_args)
        return ServerProcess(
            args, port=SERVER_PORT, env=self._env(name), host=host.address, prefix=self.net.command(host)
        )

    def kill(self, name: str) -> None:
        self.servers[name].kill()

    def restart(self, name: str) -> None:
        """A fresh process on the same host and port (memory empty)."""
        self.servers[name].restart()

    def host(self, name: str) -> Host:
        return self.hosts[name]

    def on_client(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn(*args, **kwargs)`` on the client host (its thread's sockets live there)."""
        return self.client.submit(fn, *args, **kwargs).result()

    def close(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.net.close()  # ends the storage processes too

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _create_s3_bucket(proc: subprocess.Popen[Any]) -> None:
    """Once moto answers (from the switch host), create the fleet's bucket."""
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection((SWITCH_ADDRESS, MOTO_PORT), timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto's S3 server did not start") from None
            time.sleep(0.05)
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=f"http://{SWITCH_ADDRESS}:{MOTO_PORT}",
        region_name="us-east-1",
        aws_access_key_id="test",
        aws_secret_access_key="test",
    )
    s3.create_bucket(Bucket=S3_BUCKET)
