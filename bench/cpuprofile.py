"""Where each server's CPU goes per request, in time: ``python -m bench.cpuprofile``.

``bench.instructions`` counts instructions, which do not move with the host, but an
instruction can cost 1 ns or 1 µs: a string copy that stalls (bench.copytrap) is one
instruction to valgrind. This samples each server with ``perf record -e cpu-clock`` while
one blocking client (the bench's driver, as in ``bench.versus``) sends it one request at a
time, or ``--depth`` pipelined, for ``--seconds``, then divides the samples by the requests
answered: the server's CPU per request in µs, in the kernel and in user space, and the user
space functions that take most of it, lmserver and Redis side by side. Samples are taken in
time, so the figures carry the host's noise and perf's own cost (every figure is a few
percent high); read the ratios between the servers, from one run.

Needs ``perf`` on PATH and allowed to sample another process (``perf_event_paranoid`` at 1 or
less, or root).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .drivers import OneObject
from .report import parse_size
from .targets import Target, start_lmserver, start_redis_local

FREQUENCY = 10_000  # samples per second of CPU: one per 100 µs


@dataclass
class Profile:
    """One server's samples per request: in all, in the kernel, and by user-space function."""

    name: str
    requests_per_s: float
    kernel_us: float
    user_us: float
    functions: dict[str, float]  # "dso: symbol" -> µs per request, user space only


def perf_usable() -> str | None:
    """Why ``perf record`` cannot sample here, or None when it can."""
    if shutil.which("perf") is None:
        return "perf is not on PATH"
    probe = subprocess.run(
        ["perf", "record", "-q", "-e", "cpu-clock", "-o", os.devnull, "--", "true"],
        capture_output=True,
        text=True,
    )
    return None if probe.returncode == 0 else f"perf record failed: {probe.stderr.strip()[-200:]}"


def _drive(target: Target, command: str, size: int, depth: int, seconds: float, data: Path) -> float:
    """Requests per second while ``perf record`` samples ``target``, written to ``data``."""
    assert target.spec is not None and target.pid is not None
    stored, idxs = OneObject(target.spec, target.name, size), [0] * depth
    try:
        warm_until = time.monotonic() + min(1.0, seconds)
        while time.monotonic() < warm_until:
            stored.ask(command, idxs)
        record = [
            *("perf", "record", "-q", "-e", "cpu-clock", "-F", str(FREQUENCY)),
            *("-o", str(data), "-p", str(target.pid)),
        ]
        recorder = subprocess.Popen(record, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(0.3)  # perf attaches before the first sampled request
        requests, started = 0, time.monotonic()
        while time.monotonic() - started < seconds:
            stored.ask(command, idxs)
            requests += depth
        elapsed = time.monotonic() - started
        recorder.send_signal(signal.SIGINT)
        _, err = recorder.communicate(timeout=60)
        if recorder.returncode not in (0, -signal.SIGINT):
            raise SystemExit(f"perf record failed: {err.decode(errors='replace')[-300:]}")
    finally:
        stored.close()
    return requests / elapsed


SAMPLE_ROW = re.compile(r"^\s*[\d.]+%\s+(\d+)\s+(\S+)\s+\[([.k])\]\s+(.+?)\s*$")


def read_profile(name: str, data: Path, rate: float, seconds: float) -> Profile:
    """The samples of ``data`` per request (``rate`` requests per s over ``seconds``)."""
    report = subprocess.run(
        ["perf", "report", "-i", str(data), "--stdio", "--show-nr-samples", "--sort", "dso,sym"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    us_per_sample = 1e6 / FREQUENCY / (rate * seconds)
    kernel = user = 0.0
    functions: dict[str, float] = {}
    for line in report.splitlines():
        row = SAMPLE_ROW.match(line)
        if row is None:
            continue
        samples, dso, space, symbol = int(row[1]), row[2], row[3], row[4]
        if space == "k":
            kernel += samples * us_per_sample
        else:
            user += samples * us_per_sample
            functions[f"{dso}: {symbol}"] = samples * us_per_sample
    return Profile(name, rate, kernel, user, functions)


def profile(target: Target, command: str, size: int, depth: int, seconds: float, out: Path) -> Profile:
    data = out / f"{target.name}.perf.data"
    rate = _drive(target, command, size, depth, seconds, data)
    return read_profile(target.name, data, rate, seconds)


def format_profiles(profiles: list[Profile], top: int) -> str:
    """Per server: requests per s and µs of CPU per request; then the top user-space functions."""
    lines = ["| server | requests/s | CPU µs/req | kernel | user space |", "|---|---|---|---|---|"]
    for p in profiles:
        lines.append(
            f"| {p.name} | {p.requests_per_s:,.0f} | {p.kernel_us + p.user_us:.2f} "
            f"| {p.kernel_us:.2f} | {p.user_us:.2f} |"
        )
    for p in profiles:
        lines += ["", f"{p.name}, user space, µs per request:"]
        ranked = sorted(p.functions.items(), key=lambda item: item[1], reverse=True)[:top]
        lines += [f"  {us:7.3f}  {function}" for function, us in ranked]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--op", choices=["exist", "get"], default="get")
    parser.add_argument("--size", default="4K", help="object size (default 4K)")
    parser.add_argument("--depth", type=int, default=1, help="requests per round trip")
    parser.add_argument("--seconds", type=float, default=5.0, help="sampled, per server")
    parser.add_argument("--targets", default="lmserver,redis-local", help="lmserver and/or redis-local")
    parser.add_argument("--top", type=int, default=15, help="user-space functions listed per server")
    args = parser.parse_args(argv)
    reason = perf_usable()
    if reason:
        sys.exit(f"bench.cpuprofile: {reason}")
    size, profiles = parse_size(args.size), []
    with tempfile.TemporaryDirectory(prefix="bench-cpuprofile-") as tmp:
        out = Path(tmp)
        for name in args.targets.split(","):
            if name == "lmserver":
                target = start_lmserver(name, out, None, [], "1G", startup=60.0)
            elif name == "redis-local":
                target = start_redis_local(out, startup=30.0)
            else:
                sys.exit(f"bench.cpuprofile: unknown target {name!r} (lmserver, redis-local)")
            try:
                if target.spec is None:
                    sys.exit(f"{target.name} did not start: {target.note}")
                profiles.append(profile(target, args.op, size, args.depth, args.seconds, out))
            finally:
                target.stop()
    print(format_profiles(profiles, args.top))


if __name__ == "__main__":
    main()
