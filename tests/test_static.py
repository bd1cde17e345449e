"""The standing checks of the code base: ruff (lint and format) and mypy --strict."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("args", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff(args: tuple[str, ...]) -> None:
    ruff = shutil.which("ruff")
    assert ruff is not None, "ruff is missing: install the [test] extra"
    result = run(ruff, *args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict() -> None:
    result = run(sys.executable, "-m", "mypy")  # files and strictness come from pyproject.toml
    assert result.returncode == 0, result.stdout + result.stderr
