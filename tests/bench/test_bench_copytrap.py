"""``python -m bench.copytrap`` runs and reports every size at every offset (its figures are the
bench's to read, not a test's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = (2048, 4096, 16384)  # bench/copytrap.py's SIZES and AHEADS
AHEADS = (0, 8, 16, 24, 32, 64, 2048)


def test_copytrap_reports_each_size_at_each_offset() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.copytrap", "--copies", "3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    cells = [row.strip("|").split("|") for row in proc.stdout.splitlines()[2:]]
    assert [(int(size), int(ahead)) for size, ahead, *_ in cells] == [(s, a) for s in SIZES for a in AHEADS]
    assert all(float(ns.replace(",", "")) > 0 for *_, copied, framed in cells for ns in (copied, framed))
