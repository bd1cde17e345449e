"""Instructions per request on the hot path, counted by valgrind: ``python -m bench.instructions``.

Strategy: the in-process setup of bench/hotpath.py (one ``LMProtocol`` on a real store, request
bursts fed through ``get_buffer``/``buffer_updated``, replies swallowed by a stand-in
transport), run under ``valgrind --tool=callgrind`` twice per case: once without requests and
once with ``--requests`` of them. The difference divided by the number of requests is the
instruction count of serving one, start-up excluded. Unlike a timing it does not move with the
host's load, so two builds can be compared on a busy machine (an A/B of a change is one run
of each; hashes are seeded so that dicts lay out the same). Instructions are not time: a
cache miss or a 4 KiB memcpy costs more than its count says, and the kernel is not counted
at all. Needs valgrind (Debian: ``apt-get install valgrind``); runs take ~1 minute.

The counts include the stand-in transport and the feeding loop (interpreted Python): a fixed
cost per burst, the same in both builds of an A/B.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
from typing import Any

from lmproto import REPLY_SIZE, Command, Generation
from lmserver.logs import configure_logging

from .hotpath import feed, hot_connection

CASES = (("exist", 1), ("exist", 16), ("exist", 300), ("get", 16))
"""(command, requests per burst); GETs are of one 4 KiB object."""


def _serve(command: str, depth: int, requests: int) -> None:
    """The measured process: set up, then serve ``requests`` requests in bursts of ``depth``."""

    configure_logging("warning")

    async def run() -> None:
        proto, burst = await hot_connection(Command[command.upper()], 4096, depth)
        transport: Any = proto.transport
        before = transport.written
        for _ in range(requests // depth):
            feed(proto, burst)
        # Every request answered (a hit: the object's header, and its bytes for a GET), or
        # the count would be of something else.
        reply = REPLY_SIZE[Generation.V1] + (4096 if command == "get" else 0)
        if transport.written - before != requests // depth * depth * reply:
            raise SystemExit(f"{command}: {transport.written - before} bytes of replies, not {requests} hits")

    asyncio.run(run())


def _instructions(command: str, depth: int, requests: int) -> int:
    """Instructions the whole process executed (callgrind's total)."""
    report = subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            "--callgrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "bench.instructions",
            "--serve",
            command,
            str(depth),
            str(requests),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0"},
    ).stderr
    found = re.search(r"Collected : ([0-9]+)", report) or re.search(r"refs:\s+([0-9,]+)", report)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's report:\n{report}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=19200, help="per case (a multiple of every depth)")
    parser.add_argument("--serve", nargs=3, metavar=("COMMAND", "DEPTH", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        command, depth, requests = args.serve
        _serve(command, int(depth), int(requests))
        return
    if shutil.which("valgrind") is None:
        sys.exit("bench.instructions needs valgrind (Debian: apt-get install valgrind)")
    print("| request | depth | instructions per request |")
    print("|---|---|---|")
    for command, depth in CASES:
        requests = args.requests // depth * depth
        extra = _instructions(command, depth, requests) - _instructions(command, depth, 0)
        name = "4 KiB get" if command == "get" else command
        print(f"| {name} | {depth} | {extra / requests:.0f} |")


if __name__ == "__main__":
    main()
