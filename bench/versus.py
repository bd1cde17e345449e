"""EXIST, GET and PUT, lmserver against Redis (or another build), interleaved: ``python -m bench.versus``.

Why this exists: ``python -m bench run`` measures one server after the other, so on a shared
host a ratio also carries whatever the host's load did between the two blocks (a third, in
minutes, on the development VM). Here both servers run for the whole session (the idle one
costs nothing) and each cell is measured in rounds, alternating which server goes first
(A B, B A, ...), so the two figures of a round are seconds apart. The table gives, per cell,
the median of the per-round ratios and their range, with each server's median requests/s
and server CPU per request. Same clients and drivers as ``bench run``; each client cycles over
up to 512 keys, at most 256 MiB of objects per cell (PUT overwrites them: buffers are reused,
as in an engine's steady state).

    python -m bench.versus                                  # EXIST and 4 KiB GET, 1/4/16 clients
    python -m bench.versus --rounds 5 --depths 1,16,1000 --clients 1 --ops exist
    python -m bench.versus --baseline ../before             # against another lmserver build
    python -m bench.versus --ops put --size 4M --clients 1 --baseline ../before  # PUT, A/B
    python -m bench.versus --ops put,get --size 4M --clients 1 --depths 1 --peer store  # #15 goal 2

Before the first cell and after the last, a raw peer answers one client's sequential EXISTs
for a second: the host's own round trip at the time, printed below the table with the run's
CPU steal, and a warning when the two probes disagree or other guests took the CPU
(bench/hostcheck.py). Two runs on hosts whose probes differ are not comparable cell by cell.

``--peer store`` (or ``raw``) puts a limit in Redis's place: a raw peer that stores nothing
(bench/rawserver.py), measured in the same interleaved rounds, so a ratio to it does not carry
the host's drift between two blocks of ``bench run``. ``--baseline DIR`` puts another checkout
of lmserver there: an A/B of a change, interleaved the same way. Build it in place first (``git
worktree add ../before HEAD~1 && cd ../before && python setup.py build_ext --inplace``, with
this virtual environment active); it runs with this interpreter and packages, its own
``lmserver`` and ``lmproto`` first on the path (``python -P``: not the current directory's).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

from . import hostcheck, report
from .cli import measure_cell
from .targets import Target, baseline_command, start_lmserver, start_raw, start_redis_local
from .worker import CellSpec, ClientPool

KEYS_PER_CLIENT = 512
KEY_BUDGET = 256 << 20
"""Bytes of distinct objects per cell at most (fewer keys per client for large objects), so
that neither server evicts and Redis, which runs without maxmemory, stays small."""
OPS = ("exist", "get", "put")
PEERS = {"redis": "Redis", "store": "store limit", "raw": "raw limit"}
"""``--peer`` choices and their names in the table. The two limits are bench/rawserver.py: the
store limit receives each PUT into, and sends each GET from, the next of a ring of buffers of
KEY_BUDGET bytes in all (cold in the CPU caches, as a store's objects are); the raw limit uses
one warm buffer per connection, faster than any store can be."""


def measure(
    pool: ClientPool, target: Target, op: str, size: int, clients: int, depth: int, seconds: float
) -> dict[str, Any]:
    """One timed cell on ``target`` (keys stored first, untimed): requests/s and CPU/request."""
    assert target.spec is not None
    keys = max(1, min(KEYS_PER_CLIENT, KEY_BUDGET // (size * clients)))
    preload = op != "put"  # what GET and EXIST look up is stored first; PUTs store their own
    spec = CellSpec(target.spec, op, size, depth, keys, seconds, 10**9, clients, preload=preload)
    cell, problem = measure_cell(pool, target, spec)
    return {
        "ops_per_s": cell["ops_per_s"],
        "cpu_us_per_op": cell["cpu_us_per_op"],
        "problem": problem or (cell["client_errors"] or [None])[0],
    }


def run(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every cell's row, and what the host was like over them (bench/hostcheck.py)."""
    # The baseline's command first: it refuses a folder that is no checkout before any server starts.
    baseline = None if args.baseline is None else baseline_command(args.baseline)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    clients = [int(c) for c in args.clients.split(",")]
    pool = ClientPool([*clients, 1])  # the host probe runs one client
    probe = start_raw("host-probe")
    servers = [start_lmserver("lmserver", out, None, [], "1GiB")]
    if baseline is not None:
        servers.append(start_lmserver("baseline", out, baseline, [], "1GiB"))
    elif args.peer == "store":
        servers.append(start_raw("store", KEY_BUDGET))
    elif args.peer == "raw":
        servers.append(start_raw("raw"))
    else:
        servers.append(start_redis_local(out))
    rows: list[dict[str, Any]] = []
    host: dict[str, Any] = {}
    try:
        for s in [*servers, probe]:
            if s.spec is None:
                raise SystemExit(f"{s.name}: {s.note}")
        for s in servers:
            if s.note:
                print(f"note: {s.name} {s.note}", flush=True)
        ticks = hostcheck.cpu_ticks()
        host["probe_before_per_s"] = probe_host(pool, probe)
        print(header("baseline" if args.baseline is not None else PEERS[args.peer]), flush=True)
        size = report.parse_size(args.size)
        for op, n, depth in itertools.product(
            args.ops.split(","), clients, [int(d) for d in args.depths.split(",")]
        ):
            per: dict[str, list[dict[str, Any]]] = {s.name: [] for s in servers}
            for r in range(args.rounds):
                for s in servers if r % 2 == 0 else servers[::-1]:
                    per[s.name].append(measure(pool, s, op, size, n, depth, args.duration))
            rows.append(summarize(op, size, n, depth, per, servers[1].name))
            print(format_row(rows[-1]), flush=True)
        host["probe_after_per_s"] = probe_host(pool, probe)
        host["steal"] = hostcheck.steal_share(ticks, hostcheck.cpu_ticks())
        host["warnings"] = hostcheck.warnings(
            host["probe_before_per_s"], host["probe_after_per_s"], host["steal"]
        )
        print(hostcheck.describe(host["probe_before_per_s"], host["probe_after_per_s"], host["steal"]))
    finally:
        for s in [*servers, probe]:
            s.stop()
        pool.close()
    return rows, host


def probe_host(pool: ClientPool, probe: Target) -> float | None:
    """One client's sequential EXISTs per second against the raw peer (bench/hostcheck.py)."""
    rate: float | None = measure(pool, probe, "exist", 4096, 1, 1, hostcheck.PROBE_SECONDS)["ops_per_s"]
    return rate


def summarize(
    op: str, size: int, clients: int, depth: int, per: dict[str, list[dict[str, Any]]], peer: str
) -> dict[str, Any]:
    lm, rd = per["lmserver"], per[peer]
    ratios = [
        a["ops_per_s"] / b["ops_per_s"]
        for a, b in zip(lm, rd, strict=True)
        if a["ops_per_s"] and b["ops_per_s"]
    ]

    def median(rounds: list[dict[str, Any]], key: str) -> float | None:
        values = [m[key] for m in rounds if m[key] is not None]
        return statistics.median(values) if values else None

    return {
        "op": op,
        "size": size,
        "clients": clients,
        "depth": depth,
        "ratio_median": statistics.median(ratios) if ratios else None,
        "ratio_min": min(ratios, default=None),
        "ratio_max": max(ratios, default=None),
        "peer": peer,
        "lmserver_ops_per_s": median(lm, "ops_per_s"),
        "peer_ops_per_s": median(rd, "ops_per_s"),
        "lmserver_cpu_us": median(lm, "cpu_us_per_op"),
        "peer_cpu_us": median(rd, "cpu_us_per_op"),
        "problems": [m["problem"] for m in lm + rd if m["problem"]],
        "rounds": per,
    }


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def format_row(row: dict[str, Any]) -> str:
    return (
        f"| {row['op']} | {report.fmt_size(row['size'])} | {row['clients']} | {row['depth']} "
        f"| {_f(row['ratio_median'], '.2f')} ({_f(row['ratio_min'], '.2f')}-{_f(row['ratio_max'], '.2f')}) "
        f"| {_f(row['lmserver_ops_per_s'] and row['lmserver_ops_per_s'] / 1e3, '.3g')} "
        f"| {_f(row['peer_ops_per_s'] and row['peer_ops_per_s'] / 1e3, '.3g')} "
        f"| {_f(row['lmserver_cpu_us'], '.2f')} | {_f(row['peer_cpu_us'], '.2f')} |"
        + (f" {row['problems'][0]}" if row["problems"] else "")
    )


def header(peer: str) -> str:
    return (
        f"| op | size | clients | depth | x {peer}, median (range) | lmserver k/s | {peer} k/s "
        f"| lmserver CPU us/req | {peer} CPU us/req |\n|---|---|---|---|---|---|---|---|---|"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="exist,get", help="comma list of exist, get, put")
    parser.add_argument("--size", default="4K", help="object size for GET and PUT (default 4K)")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--depths", default="1,16", help="pipeline depths (1 = one at a time)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument(
        "--peer",
        choices=PEERS,
        default="redis",
        help="what to compare with: Redis; the store limit (a raw receiver/sender cycling through "
        "cold buffers, issue #15's PUT and GET goal); the raw loopback limit (one warm buffer)",
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another lmserver checkout (built in place) to compare with, instead of --peer",
    )
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / f"versus-{stamp}")
    args = parser.parse_args(argv)
    unknown = set(args.ops.split(",")) - set(OPS)
    if unknown:
        parser.error(f"--ops: unknown {', '.join(sorted(unknown))} (choose from {', '.join(OPS)})")
    if args.baseline is not None and args.peer != "redis":
        parser.error("--baseline replaces --peer: give one of them")
    rows, host = run(args)
    (args.out / "versus.json").write_text(
        json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "host": host, "rows": rows}, indent=1)
    )
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
