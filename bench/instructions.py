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

``--servers`` counts whole server processes instead: ``python -m lmserver`` and
``redis-server`` (and with ``--baseline DIR`` another lmserver checkout, built in place, for an
A/B of a change: see bench/versus.py), each started under callgrind, answering the bench's own blocking client
over loopback (one at a time and 16 pipelined, EXIST and 4 KiB GET of one stored key). Each
case is counted from a zeroed counter to a dump (``callgrind_control``), so start-up and the
priming PUT are not in it. This is the user-space side of a request, event loop and interpreter
included, which is what the two servers spend beyond the kernel's share (the same system calls
for both, not counted). Timers that fire by the wall clock (Redis's ``serverCron``, our idle
checks) run ~50x more often per request under valgrind than at full speed: a few percent here.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmproto import REPLY_SIZE, Command, Generation
from lmserver.logs import configure_logging

from .drivers import OneObject
from .hotpath import feed, hot_connection
from .targets import Target, baseline_command, start_lmserver, start_redis_local

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


SERVER_CASES = (("exist", 1), ("get", 1), ("exist", 16), ("get", 16))
"""(command, requests per round trip) for ``--servers``; GETs are of one 4 KiB object."""


def _callgrind(out: Path, name: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out / name}.cg"]


def _count(target: Target, out: Path, work: Callable[[], None]) -> int:
    """Instructions ``target``'s process executes while ``work`` runs: its counters are zeroed,
    ``work`` runs, the counters are dumped (callgrind numbers its dumps: ``NAME.cg.1``, ``.2``,
    ...) and read."""
    assert target.pid is not None
    dump = out / f"{target.name}.cg.{len(list(out.glob(f'{target.name}.cg.*'))) + 1}"  # the next one
    subprocess.run(["callgrind_control", "--zero", str(target.pid)], check=True, capture_output=True)
    work()
    subprocess.run(["callgrind_control", "--dump", str(target.pid)], check=True, capture_output=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if dump.exists():
            found = re.search(r"^totals: ([0-9]+)", dump.read_text(errors="replace"), re.MULTILINE)
            if found:
                return int(found.group(1))
        time.sleep(0.1)
    raise RuntimeError(f"callgrind wrote no dump {dump}")


def _server_counts(target: Target, out: Path, requests: int) -> dict[tuple[str, int], float]:
    """Instructions per request of each SERVER_CASES case, the bench's client driving ``target``."""
    assert target.spec is not None
    stored = OneObject(target.spec, target.name, 4096)
    counts = {}
    for command, depth in SERVER_CASES:
        idxs = [0] * depth
        rounds = requests // depth

        def work(command: str = command, idxs: list[int] = idxs, rounds: int = rounds) -> None:
            for _ in range(rounds):
                stored.ask(command, idxs)

        counts[command, depth] = _count(target, out, work) / (rounds * depth)
    stored.close()
    return counts


def servers(requests: int, baseline: Path | None = None) -> None:
    """Print whole-process instructions per request, lmserver against redis-server (and
    against the lmserver checkout ``baseline``, if given: an A/B of a change)."""
    if shutil.which("redis-server") is None or shutil.which("callgrind_control") is None:
        sys.exit("bench.instructions --servers needs redis-server and valgrind on PATH")
    os.environ["PYTHONHASHSEED"] = "0"  # the servers inherit it: dicts lay out the same each run
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        out = Path(tmp)
        commands = {"lmserver": " ".join([*_callgrind(out, "lmserver"), sys.executable, "-m", "lmserver"])}
        if baseline is not None:
            commands["baseline"] = baseline_command(baseline, _callgrind(out, "baseline"))
        for name in [*commands, "redis-local"]:  # one at a time: each counted alone
            if name == "redis-local":
                target = start_redis_local(out, startup=60.0, wrapper=_callgrind(out, name))
            else:
                target = start_lmserver(name, out, commands[name], [], "1G", startup=180.0)
            try:
                if target.skipped:
                    sys.exit(f"{target.name} did not start: {target.note}")
                results[target.name] = _server_counts(target, out, requests)
            finally:
                target.stop()
    print(format_server_counts(results))


def format_server_counts(results: dict[str, dict[tuple[str, int], float]]) -> str:
    """The table of ``servers``: lmserver, the baseline if counted, Redis, and the ratios."""
    ab = "baseline" in results
    columns = ["request", "depth", "lmserver", *(["baseline"] if ab else []), "redis-server"]
    columns += ["lmserver / redis", *(["lmserver / baseline"] if ab else [])]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for command, depth in SERVER_CASES:
        lm, redis = results["lmserver"][command, depth], results["redis-local"][command, depth]
        row = f"| {'4 KiB get' if command == 'get' else command} | {depth} | {lm:,.0f} |"
        if ab:
            row += f" {results['baseline'][command, depth]:,.0f} |"
        row += f" {redis:,.0f} | {lm / redis:.2f} |"
        if ab:
            row += f" {lm / results['baseline'][command, depth]:.2f} |"
        lines.append(row)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=19200, help="per case (a multiple of every depth)")
    parser.add_argument(
        "--servers",
        action="store_true",
        help="whole server processes over loopback, lmserver against redis-server (user space)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="with --servers: also count another lmserver checkout, built in place (an A/B)",
    )
    parser.add_argument("--serve", nargs=3, metavar=("COMMAND", "DEPTH", "REQUESTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        command, depth, requests = args.serve
        _serve(command, int(depth), int(requests))
        return
    if args.servers:
        servers(args.requests, args.baseline)
        return
    if args.baseline is not None:
        parser.error("--baseline goes with --servers")
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
