"""``python -m bench fleet``: an lmserver fleet on a network of Linux namespaces, measured.

Strategy: ``tests/netfleet`` builds the network (a switch that is also the storage host, server
hosts, a client host; each host's link shaped to ``--link-rate``, as a NIC of that speed, so
servers are bound by their links as in a real fleet rather than all by the same two CPUs), puts
the shared tier's storage on the switch host (moto's S3 server through the NIXL OBJ tier, or
the fake Hub through the HF tier: ``--tier``) and lmserver processes on the hosts. Clients are
``bench.fleet_worker`` processes on the client host (an AsyncClient each, as the LMCache plugin
uses: a multi-key call goes to every server at once). Three measurements:

* **throughput**: aggregate PUT and GET with 1, 2 and 3 servers, ``--clients`` workers at once,
  each its own ``--objects`` keys of ``--size`` bytes (PUT: pipelined, done when an EXIST_MANY
  of them says all are stored; GET: into buffers, every byte compared). The shared tier is in
  ``mode=demote`` here: the storage runs in Python on the same CPUs, and a write-behind would
  measure it. Rounds rotate the order of the server counts; medians, and each round's ratio to
  one server.
* **replace**: three servers writing behind to the shared tier; a reader on the client host
  GETs every key in turn; one server is SIGKILLed and a fresh one started in its place at once.
  The miss rate while it is away, the time from its spawn to its ``listening`` line (it lists
  the shared tier first) and to the first GET it serves (from the shared tier: its memory is
  empty), and wrong bytes (must be 0).
* **dead host**: how long one GET takes for a key on a server whose link is cut, with a
  connection already open or not, for lmclient's default ``Timeout(30, connect=5)``, the LMCache
  plugin's ``Timeout(10, connect=2)`` and ``Timeout(1, connect=0.5)``; and the next GET of
  another of its keys, which the client answers as a miss without trying (the server is
  skipped for a while). ``--baseline DIR`` runs the same with another checkout's lmclient.

Needs root (namespaces, tc) and the nixl or hf extra for ``--tier``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the namespace fleet is test infrastructure

from netfleet import unavailable  # noqa: E402
from netfleet.fleet import Fleet  # noqa: E402

from .fleet_worker import keys_of, value  # noqa: E402
from .report import parse_size  # noqa: E402

MiB = 1024 * 1024
DEAD_HOST_TIMEOUTS = (("lmclient default", 30.0, 5.0), ("LMCache plugin", 10.0, 2.0), ("small", 1.0, 0.5))


@dataclass
class Options:
    tier: str = "s3"
    link_rate: str = "1gbit"
    size: int = MiB
    objects: int = 64
    clients: int = 3
    rounds: int = 3
    memory: str = "768MiB"
    replace_objects: int = 90
    baseline: Path | None = None
    smoke: bool = False
    parts: tuple[str, ...] = ("throughput", "replace", "dead-host")


# -- workers on the client host --------------------------------------------------------------


class Workers:
    """Worker processes on the client host, released together."""

    def __init__(self, fleet: Fleet, argvs: list[list[str]], env: dict[str, str] | None = None) -> None:
        self.procs = [
            fleet.net.popen(
                fleet.client_host,
                [sys.executable, "-m", "bench.fleet_worker", *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                cwd=REPO,
                env={**os.environ, **(env or {})},
                text=True,
            )
            for argv in argvs
        ]
        for proc in self.procs:
            self._line(proc)  # {"ready": true}

    @staticmethod
    def _line(proc: subprocess.Popen[str]) -> dict[str, Any]:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"a fleet worker exited ({proc.wait()})")
        return dict(json.loads(line))

    def go(self) -> list[dict[str, Any]]:
        for proc in self.procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results = [self._line(proc) for proc in self.procs]
        for proc in self.procs:
            proc.wait(30)
        return results


def baseline_env(baseline: Path | None) -> dict[str, str]:
    if baseline is None:
        return {}
    return {"PYTHONPATH": f"{baseline / 'clients'}:{baseline / 'protocol'}", "LMSERVER_PURE": "1"}


# -- throughput ------------------------------------------------------------------------------


def throughput(fleet: Fleet, opts: Options) -> dict[str, Any]:
    counts = (1, 2, 3)
    cells: dict[tuple[int, str], list[float]] = {(n, op): [] for n in counts for op in ("put", "get")}
    ideal: dict[int, list[float]] = {n: [] for n in counts}
    wrong = misses = 0
    for round_no in range(opts.rounds):
        order = counts[round_no % 3 :] + counts[: round_no % 3]
        for n in order:
            names = [f"h{i}" for i in range(1, n + 1)]
            fleet.start(*names, mode="demote")
            servers = ",".join(fleet.address(h) for h in names)
            prefixes = [f"r{round_no}c{c}" for c in range(opts.clients)]
            ideal[n].append(balance_limit(servers.split(","), prefixes, opts.objects))
            for op in ("put", "get"):
                shape = ["--count", str(opts.objects), "--size", str(opts.size)]
                argvs = [
                    ["load", "--servers", servers, "--op", op, "--prefix", prefix, *shape]
                    for prefix in prefixes
                ]
                results = Workers(fleet, argvs).go()
                seconds = max(r["seconds"] for r in results)
                cells[(n, op)].append(sum(r["bytes"] for r in results) / seconds / 1e6)
                wrong += sum(r.get("wrong", 0) for r in results)
                misses += sum(r["misses"] for r in results)
            fleet.stop(*names)
    rows = []
    for (n, op), rates in cells.items():
        one = cells[(1, op)]
        ratios = [rate / base for rate, base in zip(rates, one, strict=True)]
        rows.append(
            {
                "servers": n,
                "op": op,
                "MB_s": statistics.median(rates),
                "MB_s_range": [min(rates), max(rates)],
                "x_one_server": statistics.median(ratios),
                "x_range": [min(ratios), max(ratios)],
                "x_placement_limit": statistics.median(ideal[n]),
            }
        )
    return {"rows": rows, "wrong": wrong, "misses": misses}


def balance_limit(servers: list[str], prefixes: list[str], count: int) -> float:
    """The most ``len(servers)`` servers can give over one when each is bound by its own link:
    1 / the largest share of the round's keys that rendezvous hashing puts on one server."""
    from lmclient import Client

    placement = Client(servers=servers)
    keys = [k for prefix in prefixes for k in keys_of(prefix, count)]
    shares = [sum(1 for k in keys if placement.server_for(k) == s) for s in servers]
    return len(keys) / max(shares)


# -- replace ---------------------------------------------------------------------------------


class SteadyReader:
    """GETs every key in turn from the client host until stopped; records each answer."""

    def __init__(self, servers: list[str], keys: list[str], size: int) -> None:
        from lmclient import Client, Retry, Timeout

        self.client = Client(servers=servers, timeout=Timeout(1.0, connect=0.5), retry=Retry(2, 0.02, 0.1))
        self.keys = keys
        self.size = size
        self.log: list[tuple[float, float, str, bool]] = []  # (GET sent, answered, key, served)
        self.wrong = 0
        self.stop = threading.Event()

    def run(self) -> None:
        buf = bytearray(self.size)
        while not self.stop.is_set():
            for key in self.keys:
                sent = time.monotonic()
                got = self.client.get_into(key, buf)
                if got is not None and buf[:got] != value(key, self.size):
                    self.wrong += 1
                self.log.append((sent, time.monotonic(), key, got is not None))


def replace(fleet: Fleet, opts: Options) -> dict[str, Any]:
    names = ("h1", "h2", "h3")
    fleet.start(*names)
    servers = [fleet.address(h) for h in names]
    keys = keys_of("replace", opts.replace_objects)
    writer = fleet.on_client(_writer, servers)
    fleet.on_client(writer.put_many, keys, [value(k, opts.size) for k in keys], ack=True)
    fleet.on_client(writer.close)
    reader: SteadyReader = fleet.on_client(SteadyReader, servers, keys, opts.size)
    running = fleet.client.submit(reader.run)
    time.sleep(1.0)  # a second of steady reads before the kill, as the baseline
    victim = fleet.address("h2")
    owned = {k for k in keys if reader.client.server_for(k) == victim}
    kill_sent = time.monotonic()
    fleet.kill("h2")  # returns once the process is gone
    killed = time.monotonic()  # a GET sent from now on cannot reach the old process
    fleet.restart("h2")  # a fresh process on the same host and port, at once
    listening = time.monotonic()
    deadline = time.monotonic() + 60
    while not any(t > listening and ok and k in owned for t, _, k, ok in reader.log[-400:]):
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    time.sleep(1.0)  # and a second after
    reader.stop.set()
    running.result()
    fleet.on_client(reader.client.close)
    rss = server_rss_mb(fleet, names)
    fleet.stop(*names)
    log = reader.log
    served = [(sent, done) for sent, done, k, ok in log if sent > killed and ok and k in owned]
    back_sent, back = served[0] if served else (float("nan"), float("nan"))
    before = [ok for sent, _, _, ok in log if sent < kill_sent]
    away = [ok for sent, _, _, ok in log if killed < sent < back_sent]
    return {
        "objects": len(keys),
        "victim_share": len(owned) / len(keys),
        "miss_rate_before": 1 - sum(before) / max(1, len(before)),
        "miss_rate_while_away": 1 - sum(away) / max(1, len(away)),
        "gets_while_away": len(away),
        "spawn_to_listening_s": listening - killed,
        "spawn_to_first_served_s": back - killed,
        "wrong": reader.wrong,
        "server_rss_mb": rss,
    }


def server_rss_mb(fleet: Fleet, names: tuple[str, ...]) -> list[float]:
    """Each server's resident memory now (MB): what sizing a host has to allow for."""
    import psutil

    rss = []
    for name in names:
        proc = fleet.servers[name].proc
        assert proc is not None
        rss.append(psutil.Process(proc.pid).memory_info().rss / 1e6)
    return rss


def _writer(servers: list[str]) -> Any:
    from lmclient import Client, Timeout

    return Client(servers=servers, timeout=Timeout(120))


# -- dead host -------------------------------------------------------------------------------


@contextmanager
def link_down(fleet: Fleet, name: str) -> Iterator[None]:
    fleet.net.link(fleet.host(name), up=False)
    try:
        yield
    finally:
        fleet.net.link(fleet.host(name), up=True)


def dead_host(fleet: Fleet, opts: Options) -> list[dict[str, Any]]:
    fleet.start("h1", "h3")
    servers = f"{fleet.address('h1')},{fleet.address('h3')}"
    rows = []
    clients = [("this checkout", None)] + ([("baseline", opts.baseline)] if opts.baseline else [])
    for client_name, checkout in clients:
        for label, total, connect in DEAD_HOST_TIMEOUTS[2:] if opts.smoke else DEAD_HOST_TIMEOUTS:
            for established in (True, False):
                argv = ["deadhost", "--servers", servers, "--timeout", str(total), "--connect", str(connect)]
                argv += ["--established"] if established else []
                workers = Workers(fleet, [argv], baseline_env(checkout))
                with link_down(fleet, "h3"):
                    (result,) = workers.go()
                rows.append(
                    {
                        "client": client_name,
                        "timeout": label,
                        "Timeout": f"Timeout({total:g}, connect={connect:g})",
                        "connection": "open" if established else "new",
                        "first_get_s": result["first_s"],
                        "next_get_s": result["next_s"],
                    }
                )
    fleet.stop("h1", "h3")
    return rows


# -- the run ---------------------------------------------------------------------------------


def run_fleet(opts: Options) -> dict[str, Any]:
    why = unavailable()
    if why is not None:
        raise SystemExit(f"bench fleet: {why}")
    started = time.time()
    result: dict[str, Any] = {
        "meta": {
            "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
            "cpus": os.cpu_count(),
            "tier": opts.tier,
            "link_rate": opts.link_rate or "unshaped",
            "size": opts.size,
            "objects_per_client": opts.objects,
            "clients": opts.clients,
            "rounds": opts.rounds,
            "baseline": str(opts.baseline) if opts.baseline else None,
        }
    }
    with (
        tempfile.TemporaryDirectory(prefix="lmserver-bench-fleet-") as tmp,
        Fleet(Path(tmp), opts.tier, hosts=3, memory=opts.memory) as fleet,  # type: ignore[arg-type]
    ):
        if opts.link_rate:
            for host in fleet.hosts.values():
                fleet.net.shape(host, opts.link_rate)
        for part, measure in (("throughput", throughput), ("replace", replace), ("dead-host", dead_host)):
            if part in opts.parts:
                result[part.replace("-", "_")] = measure(fleet, opts)
    result["meta"]["seconds"] = time.time() - started
    return result


def format_fleet(result: dict[str, Any]) -> str:
    meta = result["meta"]
    lines = [
        f"# lmserver fleet ({meta['started']}, {meta['cpus']} CPUs, shared tier {meta['tier']}, "
        f"server links {meta['link_rate']})",
    ]
    if "throughput" in result:
        lines += _format_throughput(meta, result["throughput"])
    if "replace" in result:
        r = result["replace"]
        lines += [
            "",
            f"Replace (one of three servers SIGKILLed and a fresh one started at once; {r['objects']} "
            f"objects, its share {r['victim_share']:.0%}): misses {r['miss_rate_before']:.1%} before, "
            f"{r['miss_rate_while_away']:.1%} of {r['gets_while_away']} GETs while it was away; spawn "
            f"to listening {r['spawn_to_listening_s']:.2f} s, to its first GET served (from the shared "
            f"tier) {r['spawn_to_first_served_s']:.2f} s; wrong bytes {r['wrong']}; servers' RSS after "
            f"it: {', '.join(f'{mb:.0f}' for mb in r['server_rss_mb'])} MB.",
        ]
    if "dead_host" in result:
        lines += [
            "",
            "Dead host (its link cut): one GET of a key on it, and the next GET of another of its keys:",
            "",
            "| client | timeout | connection | first GET s | next GET s |",
            "|---|---|---|---|---|",
        ]
        for d in result["dead_host"]:
            lines.append(
                f"| {d['client']} | {d['timeout']}: `{d['Timeout']}` | {d['connection']} "
                f"| {d['first_get_s']:.2f} | {d['next_get_s']:.4f} |"
            )
    lines += ["", f"Run took {meta['seconds']:.0f} s."]
    return "\n".join(lines)


def _format_throughput(meta: dict[str, Any], t: dict[str, Any]) -> list[str]:
    lines = [
        "",
        f"Throughput: {meta['clients']} clients, {meta['objects_per_client']} objects of "
        f"{meta['size'] // 1024} KiB each, median of {meta['rounds']} rounds [range]:",
        "",
        "| servers | PUT MB/s | x 1 server | GET MB/s | x 1 server | placement's limit |",
        "|---|---|---|---|---|---|",
    ]
    rows = {(r["servers"], r["op"]): r for r in t["rows"]}
    for n in (1, 2, 3):
        cells = []
        for op in ("put", "get"):
            r = rows[(n, op)]
            low, high = r["MB_s_range"]
            cells.append(f"{r['MB_s']:.0f} [{low:.0f}-{high:.0f}] | {r['x_one_server']:.2f}")
        limit = rows[(n, "put")]["x_placement_limit"]
        lines.append(f"| {n} | {' | '.join(cells)} | {limit:.2f} |")
    lines += [
        "",
        "(placement's limit: 1 / the largest share of the keys on one server, the most that n",
        "servers bound by their own links can give over one.)",
        f"Wrong bytes: {t['wrong']}; misses: {t['misses']}.",
    ]
    return lines


def options_from(args: Any) -> Options:
    opts = Options(
        tier=args.tier,
        link_rate="" if args.link_rate in ("", "0", "none") else args.link_rate,
        size=parse_size(args.size),
        objects=args.objects,
        clients=args.clients,
        rounds=args.rounds,
        baseline=Path(args.baseline).resolve() if args.baseline else None,
        smoke=args.smoke,
        parts=tuple(p.strip() for p in args.parts.split(",") if p.strip()),
    )
    if args.smoke:
        opts.size, opts.objects, opts.clients, opts.rounds, opts.replace_objects = 64 * 1024, 4, 1, 1, 12
    return opts
