"""Fixtures for tier tests: the fake Hugging Face Hub (``tests/fakehub``)."""

from fakehub.fixtures import hub, make_tier, no_backoff

__all__ = ["hub", "make_tier", "no_backoff"]
