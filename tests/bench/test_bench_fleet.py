"""``python -m bench fleet``: end to end on a small namespace fleet (its replace and dead-host
parts; figures are not asserted, only that they are measured and no byte is wrong), and the
throughput table it prints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import netfleet
import pytest

REPO = Path(__file__).resolve().parents[2]


def test_fleet_bench_smoke(tmp_path: Path) -> None:
    why = netfleet.unavailable()
    if why is not None:
        pytest.skip(why)
    pytest.importorskip("huggingface_hub")
    out = tmp_path / "fleet"
    argv = ["fleet", "--smoke", "--tier", "hf", "--parts", "replace,dead-host", "--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-m", "bench", *argv], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads((out / "fleet.json").read_text())
    replaced = doc["replace"]
    assert replaced["wrong"] == 0 and replaced["gets_while_away"] > 0
    assert 0 < replaced["spawn_to_listening_s"] <= replaced["spawn_to_first_served_s"]
    assert [(d["connection"], d["next_get_s"] < 1) for d in doc["dead_host"]] == [
        ("open", True),
        ("new", True),
    ]
    assert "Dead host" in result.stdout


def test_fleet_bench_tables_throughput() -> None:
    from bench.fleet import format_fleet

    rows = [
        {
            "servers": n,
            "op": op,
            "MB_s": 100.0 * n,
            "MB_s_range": [90.0 * n, 110.0 * n],
            "x_one_server": n,
            "x_range": [n, n],
            "x_placement_limit": n,
        }
        for n in (1, 2, 3)
        for op in ("put", "get")
    ]
    meta = {"started": "now", "cpus": 2, "tier": "s3", "link_rate": "1gbit", "size": 1 << 20}
    meta |= {"objects_per_client": 8, "clients": 2, "rounds": 3, "seconds": 1.0}
    text = format_fleet({"meta": meta, "throughput": {"rows": rows, "wrong": 0, "misses": 0}})
    assert "| 3 | 300 [270-330] | 3.00 | 300 [270-330] | 3.00 | 3.00 |" in text
    assert "Wrong bytes: 0; misses: 0." in text
