"""``python -m bench.cpuprofile`` samples a real server under load and reports its CPU per
request, split into kernel and user space, with the user-space functions behind it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_cpuprofile_reports_cpu_per_request_and_where_it_goes() -> None:
    args = ["--targets", "lmserver", "--seconds", "0.5", "--top", "3"]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cpuprofile", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    if proc.returncode != 0 and "bench.cpuprofile: perf" in proc.stderr:
        pytest.skip(proc.stderr.strip())  # no perf here, or not allowed to sample: the tool says which
    assert proc.returncode == 0, proc.stderr
    row = re.search(r"^\| lmserver \| ([\d,]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", proc.stdout, re.M)
    assert row is not None, proc.stdout
    rate, total, kernel, user = (float(x.replace(",", "")) for x in row.groups())
    assert rate > 0 and total > 0 and abs(kernel + user - total) < 0.02
    functions = proc.stdout.split("lmserver, user space, µs per request:\n")[1].splitlines()
    assert 1 <= len(functions) <= 3 and all(re.match(r"^ +[\d.]+  \S", f) for f in functions)


def test_cpuprofile_refuses_an_unknown_target() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cpuprofile", "--targets", "memcached"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "unknown target 'memcached'" in proc.stderr or "perf" in proc.stderr
