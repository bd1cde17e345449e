"""``python -m bench lmcache`` and ``lmcache-l2`` end to end on a few small chunks (figures are
not asserted). lmcache-l2 runs without Redis, as CI has none: the lmserver adapter and fs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if not os.environ.get("CI"):
    pytest.importorskip("lmcache", reason="LMCache is not installed (see .ci/run)")


def bench(command: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python -m bench COMMAND ARGS --no-latest --out OUT``; it must succeed."""
    result = subprocess.run(
        [sys.executable, "-m", "bench", command, *args, "--no-latest", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def test_lmcache_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "lmcache"
    result = bench("lmcache", out, "--chunks", "6", "--chunk-size", "64K", "--rounds", "1", "--lookups", "2")
    doc = json.loads((out / "lmcache.json").read_text())
    assert sorted(row["via"] for row in doc["rows"]) == ["builtin", "lmclient", "plugin"]
    assert all(row["store_gbps"] > 0 and row["retrieve_gbps"] > 0 for row in doc["rows"])
    assert "plugin / built-in" in result.stdout


def test_lmcache_l2_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "l2"
    args = [
        "--sizes",
        "64K,1M",
        "--chunks",
        "32,16",
        "--rounds",
        "2",
        "--lookups",
        "4",
        "--adapters",
        "lmserver,fs",
    ]
    result = bench("lmcache-l2", out, *args)
    doc = json.loads((out / "lmcache_l2.json").read_text())
    assert sorted({row["adapter"] for row in doc["rows"]}) == ["fs", "lmserver"]
    assert len(doc["rows"]) == 2 * 2 * 2
    assert all(row["loaded"] == row["verified"] == row["chunks"] for row in doc["rows"])
    assert all(row["store_gbps"] > 0 and row["load_gbps"] > 0 for row in doc["rows"])
    assert "| 16 x 1 MiB | lmserver |" in result.stdout
