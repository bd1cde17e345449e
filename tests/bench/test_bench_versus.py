"""``python -m bench.versus`` end to end: both servers started, every cell measured in
alternating rounds, the table and JSON written. No timing assertions."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import lmserver

REPO = Path(__file__).resolve().parents[2]


def versus(
    *args: str, cwd: Path = REPO, timeout: float = 300, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """``python -m bench.versus`` with these arguments, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "bench.versus", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_versus_measures_every_cell_in_alternating_rounds(tmp_path: Path) -> None:
    out = tmp_path / "vs"
    args = ["--ops", "exist,get", "--clients", "1,2", "--depths", "1,4"]
    args += ["--rounds", "2", "--duration", "0.05"]
    proc = versus(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "versus.json").read_text())["rows"]
    assert [(r["op"], r["clients"], r["depth"]) for r in rows] == [
        (op, n, d) for op in ("exist", "get") for n in (1, 2) for d in (1, 4)
    ]
    for r in rows:
        assert not r["problems"], r["problems"]
        assert r["peer"] == "redis-local"
        assert all(len(r["rounds"][s]) == 2 for s in ("lmserver", "redis-local"))
        assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
        assert r["lmserver_cpu_us"] is not None and r["peer_cpu_us"] is not None
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(rows)  # the header, then a line per cell as it is measured
    assert "x Redis" in table[0]


def test_versus_compares_with_another_checkout(tmp_path: Path) -> None:
    """``--baseline``: another lmserver checkout in Redis's place (here this one: its own
    modules, not the current directory's, are the ones it runs)."""
    out = tmp_path / "ab"
    args = ["--ops", "get,put", "--clients", "1", "--depths", "1,4", "--rounds", "2", "--duration", "0.05"]
    proc = versus(
        *args,
        "--baseline",
        str(REPO),
        "--out",
        str(out),
        cwd=tmp_path,  # not the checkout: what the baseline imports comes from --baseline alone
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "versus.json").read_text())["rows"]
    assert [(r["op"], r["depth"]) for r in rows] == [("get", 1), ("get", 4), ("put", 1), ("put", 4)]
    for r in rows:
        assert not r["problems"], r["problems"]
        assert r["peer"] == "baseline" and len(r["rounds"]["baseline"]) == 2
        assert r["peer_cpu_us"] is not None
    assert "x baseline" in proc.stdout
    assert '"host": "127.0.0.1"' in (out / "baseline.log").read_text()  # it started and listened


def test_versus_refuses_a_baseline_that_is_not_a_checkout(tmp_path: Path) -> None:
    proc = versus("--baseline", str(tmp_path), "--out", str(tmp_path / "o"), timeout=120)
    assert proc.returncode != 0 and "not an lmserver checkout" in proc.stderr


def test_versus_refuses_an_unknown_op(tmp_path: Path) -> None:
    proc = versus("--ops", "get,delete", "--out", str(tmp_path / "x"), timeout=60)
    assert proc.returncode == 2 and "unknown delete" in proc.stderr
    assert not (tmp_path / "x").exists()  # refused before any server started


def test_versus_compares_with_the_store_limit(tmp_path: Path) -> None:
    """``--peer store``: the raw receiver/sender that cycles through cold buffers, interleaved
    like Redis (issue #15's PUT and GET goal is a ratio to it)."""
    out = tmp_path / "store"
    args = ["--ops", "put,get", "--size", "64K", "--clients", "1", "--depths", "1", "--rounds", "2"]
    args += ["--duration", "0.05", "--peer", "store", "--out", str(out)]
    proc = versus(*args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((out / "versus.json").read_text())["rows"]
    assert [r["op"] for r in rows] == ["put", "get"]
    for r in rows:
        assert not r["problems"], r["problems"]
        assert r["peer"] == "store" and len(r["rounds"]["store"]) == 2
        assert r["ratio_median"] is not None and r["peer_cpu_us"] is not None
    assert "x store limit" in proc.stdout


def test_versus_refuses_a_peer_and_a_baseline_together(tmp_path: Path) -> None:
    args = ["--peer", "raw", "--baseline", str(REPO), "--out", str(tmp_path)]
    proc = versus(*args, timeout=120)
    assert proc.returncode == 2 and "--baseline replaces --peer" in proc.stderr
    assert not (tmp_path / "versus.json").exists()


@pytest.mark.parametrize("pure", [True, False], ids=["from-source", "as-built"])
def test_a_server_running_from_source_is_noted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pure: bool
) -> None:
    """A stale build runs from source with only a warning in its log; the bench says so beside
    its figures (bench.versus prints each server's note before the table)."""
    if pure:
        monkeypatch.setenv("LMSERVER_PURE", "1")
    elif not any(lmserver.compiled().values()):
        pytest.skip("this install runs from source: there is no compiled server to start")
    monkeypatch.syspath_prepend(str(REPO))  # bench/ is not installed: the checkout's
    from bench.targets import FROM_SOURCE, start_lmserver

    target = start_lmserver("lmserver", tmp_path, None, [], "64MiB")
    try:
        assert not target.skipped, target.note
        assert (FROM_SOURCE in target.note) is pure, target.note
    finally:
        target.stop()


def test_versus_reports_the_host_it_ran_on(tmp_path: Path) -> None:
    """The host probe (a raw peer's sequential EXISTs, before and after the cells) and the
    run's CPU steal are printed below the table and kept in the JSON."""
    out = tmp_path / "host"
    args = ["--ops", "exist", "--clients", "2", "--depths", "1", "--rounds", "1", "--duration", "0.05"]
    proc = versus(*args, "--peer", "raw", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    host = json.loads((out / "versus.json").read_text())["host"]
    assert host["probe_before_per_s"] > 0 and host["probe_after_per_s"] > 0
    assert host["steal"] is None or 0 <= host["steal"] <= 1
    assert isinstance(host["warnings"], list)
    assert "host: a raw peer answered one client's sequential EXISTs at " in proc.stdout


def test_host_check_reads_steal_and_flags_a_changing_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(REPO))  # bench/ is not installed: the checkout's
    from bench import hostcheck

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 800 10 0 20 20 5 0\ncpu0 50 0 25 400 5 0 10 10 0 0\n")
    before = hostcheck.cpu_ticks(stat)
    assert before == hostcheck.CpuTicks(steal=20, total=1000)  # guest time is inside user time
    stat.write_text("cpu  200 0 100 1500 10 0 40 150 9 0\n")
    assert hostcheck.steal_share(before, hostcheck.cpu_ticks(stat)) == 0.13
    for unreadable in ("", "intr 1 2 3\n", "cpu 1 2\n"):
        stat.write_text(unreadable)
        assert hostcheck.cpu_ticks(stat) is None
    assert hostcheck.cpu_ticks(tmp_path / "missing") is None
    assert hostcheck.steal_share(None, before) is None and hostcheck.steal_share(before, before) is None

    assert hostcheck.warnings(12_000, 11_000, 0.001) == []
    moved, busy = hostcheck.warnings(40_000, 12_000, 0.05)
    assert "moved by 70%" in moved and "5.0% of the CPU time" in busy
    assert hostcheck.warnings(None, 12_000, None) == []  # a probe that failed decides nothing
    line = hostcheck.describe(12_000, None, None)
    assert line.endswith("sequential EXISTs at 12.0k/s before the cells and -/s after")
