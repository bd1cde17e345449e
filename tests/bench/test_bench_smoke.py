"""End-to-end smoke runs of the benchmark harness (``python -m bench run --smoke``).

No timing assertions: these check that the harness runs against real servers over loopback
and writes a results JSON, a markdown table and PNG plots with the expected structure.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
CELL_KEYS = {
    "target",
    "op",
    "depth",
    "size",
    "clients",
    "ops",
    "bytes",
    "seconds",
    "gbps",
    "ops_per_s",
    "lat_us",
    "server_cpu_s",
    "cpu_s_per_gb",
    "ratio_phys",
    "ratio_redis",
}
WORKLOADS = {("put", 1), ("put", 16), ("get", 1), ("get", 16), ("exist", 1), ("exist", 16), ("mixed", 1)}


def _run_bench(out: Path, *args: str) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "run", "--smoke", "--out", str(out), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert "| workload |" in proc.stdout  # the side-by-side table went to stdout
    for name in ("results.json", "table.md", "throughput.png", "latency_cdf.png", "exist.png"):
        assert (out / name).is_file(), name
    for png in out.glob("*.png"):
        assert png.read_bytes()[:8] == PNG_MAGIC, png
    doc: dict[str, Any] = json.loads((out / "results.json").read_text())
    assert {"meta", "targets", "notes", "disk_limit", "memory", "cells"} <= doc.keys()
    assert doc["meta"]["smoke"] is True
    return doc


def _cells(doc: dict[str, Any], target: str) -> list[dict[str, Any]]:
    return [c for c in doc["cells"] if c["target"] == target]


def _check_target(doc: dict[str, Any], target: str, *, expect_hits: bool = True) -> None:
    cells = _cells(doc, target)
    sizes = set(doc["meta"]["sizes"])
    clients = set(doc["meta"]["clients"])
    seen = {(c["op"], c["depth"], c["size"], c["clients"]) for c in cells}
    want = {(op, d, s, n) for op, d in WORKLOADS for s in sizes for n in clients}
    assert want <= seen, sorted(want - seen)
    for c in cells:
        assert c.keys() >= CELL_KEYS, c.keys()
        assert not c["client_errors"], c["client_errors"]
        assert c["ops"] > 0 and c["ops_per_s"] > 0
        if not c["op"].startswith("stream"):  # streams have no per-request latency
            lat = c["lat_us"]
            assert lat is not None and lat["p50"] <= lat["p99"] <= lat["p999"]
        if c["op"] in ("put", "get", "mixed"):
            assert c["gbps"] > 0 and c["ratio_phys"] is not None
        if expect_hits and c["op"] in ("get", "exist"):
            assert c["hits"] > 0, c


def test_phys_only(tmp_path: Path) -> None:
    """The physical-limit part (and the store limit) needs no server at all."""
    doc = _run_bench(tmp_path / "out", "--targets", "none")
    names = [t["name"] for t in doc["targets"]]
    assert names == ["phys", "store"]
    store = _cells(doc, "store")
    assert store and {c["op"] for c in store} == {"put", "get"} and all(c["gbps"] for c in store)
    phys = _cells(doc, "phys")
    assert {c["op"] for c in phys} >= {"stream_put", "stream_get", "put", "get", "exist", "mixed"}
    _check_target(doc, "phys")


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")
def test_redis_local(tmp_path: Path) -> None:
    doc = _run_bench(tmp_path / "out", "--targets", "redis-local")
    _check_target(doc, "redis-local")
    assert doc["memory"] and all(m["target"] == "redis-local" for m in doc["memory"])
    for c in _cells(doc, "redis-local"):
        assert c["server_cpu_s"] is not None


def test_lmserver(tmp_path: Path) -> None:
    if not (REPO / "lmserver" / "__main__.py").exists():
        pytest.skip("lmserver/__main__.py does not exist yet: the server has not landed")
    targets = "lmserver,redis-local" if shutil.which("redis-server") else "lmserver"
    doc = _run_bench(tmp_path / "out", "--targets", targets)
    by_name = {t["name"]: t for t in doc["targets"]}
    assert not by_name["lmserver"]["skipped"], by_name["lmserver"]["note"]
    _check_target(doc, "lmserver")
    for c in _cells(doc, "lmserver"):
        assert c["server_cpu_s"] is not None
        if "redis-local" in by_name and not by_name["redis-local"]["skipped"]:
            assert c["ratio_redis"] is not None
        # PUTs and GETs against the store limit
        assert (c["ratio_store"] is not None) == (c["op"] in ("put", "get")), c
    disk = by_name["lmserver+disk"]
    if disk["skipped"]:
        assert disk["note"].startswith("skipped:")
    else:
        # Objects may be evicted with a small memory limit: misses are allowed, errors are not.
        _check_target(doc, "lmserver+disk", expect_hits=False)
        assert doc["disk_limit"] and doc["disk_limit"][0]["write_fsync_gbps"] > 0


def test_given_lm_url_v1(tmp_path: Path) -> None:
    """A running server given as ``lm://HOST:PORT?v=1``: v1 frames, PID found from the socket."""
    if not (REPO / "lmserver" / "__main__.py").exists():
        pytest.skip("lmserver/__main__.py does not exist yet: the server has not landed")
    log = tmp_path / "server.log"
    with log.open("wb") as fh:
        server = subprocess.Popen(
            [sys.executable, "-m", "lmserver", "--host", "127.0.0.1", "--port", "0", "--log-format", "json"],
            cwd=REPO,
            stdout=fh,
            stderr=fh,
        )
    try:
        port = None
        deadline = time.monotonic() + 30
        while port is None and time.monotonic() < deadline and server.poll() is None:
            for line in log.read_text().splitlines():
                if '"listening"' in line:
                    port = json.loads(line)["port"]
            time.sleep(0.05)
        assert port, log.read_text()[-2000:]
        url = f"lm://127.0.0.1:{port}?v=1"
        doc = _run_bench(tmp_path / "out", "--targets", url, "--sizes", "64K", "--clients", "1")
        target = next(t for t in doc["targets"] if t["name"] == url)
        assert not target["skipped"] and target["generation"] == 1
        assert target["server_pid"] == server.pid
        _check_target(doc, url)
    finally:
        server.terminate()
        server.wait(15)


def run_module(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m module args``, run from the checkout, its output captured."""
    run = [sys.executable, "-m", module, *args]
    return subprocess.run(run, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def module_output(module: str, *args: str) -> str:
    """What ``python -m module args`` prints, run from the checkout; it must succeed."""
    proc = run_module(module, *args)
    proc.check_returncode()
    return proc.stdout


def test_hotpath_reports_every_row() -> None:
    """``python -m bench.hotpath`` drives the real protocol object and prints its table."""
    out = module_output("bench.hotpath", "--requests", "64")
    rows = [line for line in out.splitlines() if line.startswith("| ") and "µs" not in line]
    names = [row.split("|")[1].strip() for row in rows]
    assert names.count("exist") == 2 and names.count("get copy") == 5 and names.count("get pin") == 5
    assert all(float(row.split("|")[4]) > 0 for row in rows)


@pytest.mark.parametrize(("command", "depth"), [("exist", 1), ("exist", 16), ("exist", 300), ("get", 16)])
def test_instructions_serves_its_cases(command: str, depth: int) -> None:
    """The process ``python -m bench.instructions`` runs under valgrind (not needed here)
    serves every request of its case, and checks that each got its reply."""
    subprocess.run(
        [sys.executable, "-m", "bench.instructions", "--serve", command, str(depth), str(depth * 3)],
        cwd=REPO,
        timeout=120,
        check=True,
    )


def test_instructions_drives_every_server_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench.instructions --servers`` without valgrind: the client side drives each case
    against a real lmserver (every request a hit, or it exits), and the server's command line
    takes a wrapper as valgrind is put in front of it."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench import instructions
    from bench.targets import start_lmserver

    ran: list[int] = []

    def count(target: Any, out: Path, work: Any) -> int:
        work()
        ran.append(1)
        return 1000

    monkeypatch.setattr(instructions, "_count", count)
    target = start_lmserver("lmserver", tmp_path, f"env {sys.executable} -m lmserver", [], "64M")
    try:
        assert not target.skipped, target.note
        counts = instructions._server_counts(target, tmp_path, 32)
    finally:
        target.stop()
    assert len(ran) == len(instructions.SERVER_CASES)
    assert counts == {case: 1000 / 32 for case in instructions.SERVER_CASES}


def test_instructions_counts_a_baseline_checkout_and_tables_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--servers --baseline DIR``: the other checkout's server starts from its own modules
    (here this checkout, wrapped as valgrind would be) and gets its columns in the table."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench import instructions
    from bench.targets import baseline_command, start_lmserver

    monkeypatch.setattr(instructions, "_count", lambda target, out, work: work() or 640)
    target = start_lmserver("baseline", tmp_path, baseline_command(REPO, ["env"]), [], "64M")
    try:
        assert not target.skipped, target.note
        counts = instructions._server_counts(target, tmp_path, 32)
    finally:
        target.stop()
    assert counts == {case: 20 for case in instructions.SERVER_CASES}
    table = instructions.format_server_counts(
        {"lmserver": {c: 10 for c in counts}, "baseline": counts, "redis-local": {c: 40 for c in counts}}
    ).splitlines()
    assert table[0] == (
        "| request | depth | lmserver | baseline | redis-server | lmserver / redis | lmserver / baseline |"
    )
    assert table[2] == "| exist | 1 | 10 | 20 | 40 | 0.25 | 0.50 |"
    plain = instructions.format_server_counts({"lmserver": counts, "redis-local": counts}).splitlines()
    assert plain[0].count("|") == 6 and plain[2] == "| exist | 1 | 20 | 20 | 1.00 |"
    with pytest.raises(SystemExit, match="not an lmserver checkout"):
        baseline_command(tmp_path)
    refused = run_module("bench.instructions", "--baseline", str(REPO), timeout=60)
    assert refused.returncode == 2 and "--baseline goes with --servers" in refused.stderr


def test_object_overhead_prints_a_row_per_key_length() -> None:
    """``python -m bench.object_overhead`` stores objects on a real server and prints, per key
    length, its RSS growth per object (the figure itself is not checked: it is RSS)."""
    out = module_output("bench.object_overhead", "--objects", "2000", "--key-lengths", "8,150")
    rows = [line.split("|")[1:3] for line in out.splitlines() if line.startswith("| ") and "key" not in line]
    assert [int(length) for length, _ in rows] == [8, 150]
    for _, value in rows:
        float(value.replace(",", ""))  # a number, whatever its sign


def test_copytrap_reports_each_size_at_each_offset(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bench.copytrap`` times every size at every offset (its figures are the
    bench's to read, not a test's)."""
    monkeypatch.syspath_prepend(str(REPO))
    from bench.copytrap import AHEADS, SIZES

    out = module_output("bench.copytrap", "--copies", "3")
    cells = [row.strip("|").split("|") for row in out.splitlines()[2:]]
    assert [(int(size), int(ahead)) for size, ahead, *_ in cells] == [(s, a) for s in SIZES for a in AHEADS]
    assert all(float(ns.replace(",", "")) > 0 for *_, copied, framed in cells for ns in (copied, framed))


def test_cpuprofile_reports_cpu_per_request_and_where_it_goes() -> None:
    """``python -m bench.cpuprofile`` samples a real server under load and reports its CPU per
    request, split into kernel and user space, with the user-space functions behind it."""
    args = ["--targets", "lmserver", "--seconds", "0.5", "--top", "3"]
    proc = run_module("bench.cpuprofile", *args, timeout=180)
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
    proc = run_module("bench.cpuprofile", "--targets", "memcached", timeout=60)
    assert proc.returncode != 0
    assert "unknown target 'memcached'" in proc.stderr or "perf" in proc.stderr


def test_bulk_reports_both_comparisons() -> None:
    """``python -m bench.bulk``: DELETE_MANY against pipelined DELETEs, LIST_PAGE against LIST."""
    out = module_output("bench.bulk", "--keys", "300", "--batch", "64", "--page", "100", "--rounds", "2")
    assert "DELETE_MANY" in out and "pipelined DELETE" in out
    assert "LIST_PAGE" in out and "a LIST per page" in out
