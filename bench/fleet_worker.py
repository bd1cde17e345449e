"""The client side of ``python -m bench fleet``: one process on the fleet's client host (started
through ``ip netns exec``), importing only lmclient, so ``--baseline`` can run another
checkout's lmclient in its place. It talks to the harness in lines on stdin and stdout: it
prints ``{"ready": true}`` once warmed up, waits for a ``go`` line, runs, and prints one JSON
result.

``load``: PUTs (each worker its own keys, pipelined, every server's share at once; done when
an EXIST_MANY of them all says yes, which a server answers only after taking in every earlier
PUT of their connections) or GETs into preallocated buffers, every byte compared.

``deadhost``: how long one GET of a key on a server whose link the harness cut takes, and the
next GET of another of its keys (the client skips the server by then). ``--established``
first talks to that server, so the cut finds an open connection.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
import time
from typing import Any

from lmclient import AsyncClient, Client, Timeout


def value(key: str, size: int) -> bytes:
    return (hashlib.sha256(key.encode()).digest() * (size // 32 + 1))[:size]


def keys_of(prefix: str, count: int) -> list[str]:
    return [f"{prefix}@1@0@{i:016x}@bfloat16" for i in range(count)]


def say(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


def wait_for_go() -> None:
    say({"ready": True})
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("the harness went away")


def load(args: argparse.Namespace) -> dict[str, Any]:
    """An AsyncClient, as the LMCache plugin uses: each server's share of a multi-key call is
    sent at once, so the servers work in parallel (a blocking Client asks them in turn)."""
    return asyncio.run(_load(args))


async def _load(args: argparse.Namespace) -> dict[str, Any]:
    keys = keys_of(args.prefix, args.count)
    async with AsyncClient(servers=args.servers.split(","), timeout=Timeout(120)) as client:
        await client.exists_many(keys)  # opens every connection these keys use
        if args.op == "put":
            values = [value(k, args.size) for k in keys]
            wait_for_go()
            started = time.perf_counter()
            await client.put_many(keys, values)
            stored = await client.exists_many(keys)
            seconds = time.perf_counter() - started
            return {"seconds": seconds, "bytes": args.size * sum(stored), "misses": stored.count(False)}
        buffers = [bytearray(args.size) for _ in keys]
        wait_for_go()
        started = time.perf_counter()
        got = await client.get_many_into(keys, buffers)
        seconds = time.perf_counter() - started
    checked = zip(keys, got, buffers, strict=True)
    wrong = sum(1 for k, n, buf in checked if n is not None and buf != value(k, args.size))
    served = [n for n in got if n is not None]
    return {"seconds": seconds, "bytes": sum(served), "misses": len(got) - len(served), "wrong": wrong}


def deadhost(args: argparse.Namespace) -> dict[str, Any]:
    live, dead = args.servers.split(",")
    timeout = Timeout(args.timeout, connect=args.connect)
    with Client(servers=[live, dead], timeout=timeout) as client:
        on_dead = [k for k in keys_of("dead", 400) if client.server_for(k) == dead][:3]
        if args.established:  # the cut then finds open the connections these keys use
            for key in on_dead:
                client.get(key)
        wait_for_go()
        timings = []
        for key in on_dead[1:]:
            started = time.perf_counter()
            got = client.get(key)
            timings.append(time.perf_counter() - started)
            assert got is None
        return {"first_s": timings[0], "next_s": timings[1], "counters": client.counters}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fleet_worker")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ld = sub.add_parser("load")
    ld.add_argument("--servers", required=True, help="host:port,host:port,...")
    ld.add_argument("--op", choices=("put", "get"), required=True)
    ld.add_argument("--prefix", required=True)
    ld.add_argument("--count", type=int, required=True)
    ld.add_argument("--size", type=int, required=True)
    dh = sub.add_parser("deadhost")
    dh.add_argument("--servers", required=True, help="LIVE,DEAD")
    dh.add_argument("--timeout", type=float, required=True)
    dh.add_argument("--connect", type=float, required=True)
    dh.add_argument("--established", action="store_true")
    args = ap.parse_args(argv)
    say(load(args) if args.cmd == "load" else deadhost(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
