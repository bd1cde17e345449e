"""The Dockerfile's contract (no Docker engine on these machines; the image is not built).
hadolint lints it in CI (.ci/run), outside the test suite."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_contract() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "EXPOSE 65432" in text
    assert 'VOLUME ["/data"]' in text
    assert "USER 10001" in text  # never root
    assert '"health"' in text  # HEALTHCHECK goes through the protocol
    assert '"0.0.0.0"' in text and '"--disk", "/data"' in text
