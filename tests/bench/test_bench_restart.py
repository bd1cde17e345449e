"""``python -m bench restart`` end to end on a few objects (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_restart_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "restart"
    result = subprocess.run(
        [sys.executable, "-m", "bench", "restart", "--objects", "300", "--no-latest", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    doc = json.loads((out / "restart.json").read_text())
    assert doc["objects"] == 300
    for name in ("clean_restart", "after_sigkill", "index_rebuilt"):
        assert doc[name]["sample_ok"] == 200, (name, doc[name])
        assert doc[name]["seconds"] > 0
    assert "index load rate" in result.stdout
