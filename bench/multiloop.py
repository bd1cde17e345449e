"""Several event loops over one store: ``python -m bench.multiloop``.

Question (issue 15): does lmserver gain from running N event loops in N threads, each
accepting on the same port (``SO_REUSEPORT``) and all serving one shared Store, and what
does the GIL leave of that? This is a measurement, not a server mode: the server process
below is built for it (``--loops N``), the product runs one loop.

Strategy: one server process per N (1, 2, 4 loops). Each loop thread runs its own uvloop
with a listener on the shared port; the kernel spreads connections over the listeners.
Loops share the ServerState and Store (the memory tier is thread-safe; counters may lose
increments across threads, which does not matter here). Client processes, each one
connection, run sequential EXIST, sequential 4 KiB GET and pipelined EXIST (16 deep) for a
few seconds; the table gives requests per second and the ratio to one loop. Sockets are
real (loopback); the clients share the machine's cores with the server, as in every other
bench here.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from lmproto import REPLY_SIZE, Command, Generation, encode_request

GEN = Generation.V0
OBJECT = 4096
KEYS = 64


def serve(loops: int, ready: str) -> None:
    """The server process: ``loops`` event loops on one port, one Store."""
    from lmserver.config import ServerConfig
    from lmserver.connection import LMProtocol
    from lmserver.logs import configure_logging
    from lmserver.server import Server, new_event_loop

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # taken by sigwait below

    configure_logging("warning", "json")
    server = Server(ServerConfig(host="127.0.0.1", port=0, memory_limit=1 << 30))
    first = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    first.bind(("127.0.0.1", 0))
    port = first.getsockname()[1]
    started = threading.Barrier(loops + 1)

    def run_loop(sock: socket.socket | None) -> None:
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(("127.0.0.1", port))
        sock.listen(1024)
        loop = new_event_loop("auto")
        asyncio.set_event_loop(loop)
        loop.run_until_complete(loop.create_server(lambda: LMProtocol(server.state), sock=sock))
        started.wait()
        loop.run_forever()

    opener = new_event_loop("auto")
    opener.run_until_complete(server.state.store.open())  # memory only: nothing stays on this loop
    for n in range(loops):
        threading.Thread(target=run_loop, args=(first if n == 0 else None,), daemon=True).start()
    started.wait()
    Path(f"{ready}.tmp").write_text(str(port))
    os.rename(f"{ready}.tmp", ready)  # whole or absent for the reader
    signal.sigwait({signal.SIGTERM})


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("server closed the connection")
        got += n


def client(port: int, op: str, depth: int, seconds: float, start: float, out: mp.Queue[int]) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        command = Command.GET if op == "get" else Command.EXIST
        frames = [encode_request(command, f"ml-{i}", generation=GEN) for i in range(KEYS)]
        reply_size = REPLY_SIZE[GEN] + (OBJECT if op == "get" else 0)
        reply = memoryview(bytearray(reply_size * depth))
        while time.time() < start:
            time.sleep(0.001)
        done, i, deadline = 0, 0, start + seconds
        while time.time() < deadline:
            sock.sendall(b"".join(frames[(i + j) % KEYS] for j in range(depth)))
            _recv_exactly(sock, reply)
            done += depth
            i += depth
        out.put(done)


def preload(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        body = bytes(OBJECT)
        for i in range(KEYS):
            sock.sendall(encode_request(Command.PUT_ACK, f"ml-{i}", OBJECT, generation=GEN) + body)
            _recv_exactly(sock, memoryview(bytearray(REPLY_SIZE[GEN])))


def run_load(port: int, op: str, depth: int, clients: int, seconds: float) -> float:
    out: mp.Queue[int] = mp.Queue()
    start = time.time() + 0.5
    procs = [mp.Process(target=client, args=(port, op, depth, seconds, start, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 30) for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", default="1,2,4")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # the server process itself
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.ready)
        return
    loads = [("exist", 1), ("get", 1), ("exist", 16)]
    rows: dict[int, list[float]] = {}
    for loops in (int(n) for n in args.loops.split(",")):
        ready = Path(tempfile.gettempdir()) / f"lmbench-multiloop-{os.getpid()}-{loops}"
        command = [sys.executable, "-m", "bench.multiloop", "--serve", str(loops), "--ready", str(ready)]
        proc = subprocess.Popen(command)
        try:
            deadline = time.time() + 30
            while not ready.exists():
                if time.time() > deadline or proc.poll() is not None:
                    raise SystemExit("server did not start")
                time.sleep(0.05)
            port = int(ready.read_text())
            preload(port)
            rows[loops] = [run_load(port, op, depth, args.clients, args.seconds) for op, depth in loads]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(10)
            ready.unlink(missing_ok=True)
    base = rows[min(rows)]
    print(f"{args.clients} client processes, one connection each, {os.cpu_count()} CPUs")
    print("requests/s (x one loop)")
    print("| loops | " + " | ".join(f"{op} depth {d}" for op, d in loads) + " |")
    print("|---|" + "---|" * len(loads))
    for loops, rates in rows.items():
        cells = " | ".join(f"{r:,.0f} ({r / b:.2f}x)" for r, b in zip(rates, base, strict=True))
        print(f"| {loops} | {cells} |")


if __name__ == "__main__":
    main()
