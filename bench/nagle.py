"""PUT+GET round trips from a client that leaves Nagle's algorithm on: ``python -m bench.nagle``.

Upstream's v0 client sends a PUT's header and body as two writes without TCP_NODELAY, so
its second write waits for the ACK of the first; a server that lets delayed ACK run adds up
to 40 ms to every PUT followed by a read (upstream's server measured 91 small GETs/s). This
starts lmserver (or uses ``--target lm://HOST:PORT``) and reports pairs per second for a few
body sizes, with Nagle on and off, one connection, sequential.
"""

from __future__ import annotations

import argparse
import socket
import tempfile
import time
from pathlib import Path

from lmproto import Command, encode_request

from .targets import start_lmserver


def pairs_per_second(host: str, port: int, size: int, nodelay: bool, seconds: float) -> float:
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, int(nodelay))
        body = bytes(size)
        reply = bytearray(8 + size)
        view = memoryview(reply)
        pairs = 0
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            key = f"nagle-{pairs % 8}"
            sock.sendall(encode_request(Command.PUT, key, size))  # two writes, as upstream
            sock.sendall(body)
            sock.sendall(encode_request(Command.GET, key))
            got = 0
            while got < len(reply):
                n = sock.recv_into(view[got:])
                if not n:
                    raise ConnectionError("server closed the connection")
                got += n
            pairs += 1
        return pairs / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="lm://HOST:PORT of a running server (default: start lmserver)")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--sizes", default="100,4096,65536")
    args = parser.parse_args()
    managed = None
    if args.target:
        host, _, port_text = args.target.removeprefix("lm://").partition(":")
        port = int(port_text)
    else:
        managed = start_lmserver("lmserver", Path(tempfile.mkdtemp(prefix="nagle-")), None, [], "1GiB")
        if managed.spec is None:
            raise SystemExit(f"lmserver did not start: {managed.note}")
        host, port = managed.spec.host, managed.spec.port
    try:
        print("| body bytes | Nagle on: pairs/s | TCP_NODELAY: pairs/s |")
        print("|---|---|---|")
        for size in (int(s) for s in args.sizes.split(",")):
            on = pairs_per_second(host, port, size, False, args.seconds)
            off = pairs_per_second(host, port, size, True, args.seconds)
            print(f"| {size} | {on:.0f} | {off:.0f} |")
    finally:
        if managed is not None:
            managed.stop()


if __name__ == "__main__":
    main()
