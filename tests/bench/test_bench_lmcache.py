"""``python -m bench lmcache`` end to end on a few small chunks (figures are not asserted)."""

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


def test_lmcache_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "lmcache"
    args = ["--chunks", "6", "--chunk-size", "64K", "--rounds", "1", "--lookups", "2", "--no-latest"]
    result = subprocess.run(
        [sys.executable, "-m", "bench", "lmcache", *args, "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "LMCACHE_TRACK_USAGE": "false"},
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    doc = json.loads((out / "lmcache.json").read_text())
    assert sorted(row["via"] for row in doc["rows"]) == ["builtin", "lmclient", "plugin"]
    assert all(row["store_gbps"] > 0 and row["retrieve_gbps"] > 0 for row in doc["rows"])
    assert "plugin / built-in" in result.stdout
