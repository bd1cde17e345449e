"""pytest fixtures around the fake Hub: import them into a test module by name.

``HF_HOME`` must point somewhere private before ``huggingface_hub`` is first imported (it
reads its configuration at import), so this module sets it on import.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="lmserver-test-hfhome-"))
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.pop("HF_HUB_OFFLINE", None)
# hf_xet's own retries (CAS and xet-token requests): keep them, but short, so a Hub that
# went away fails a batch in well under a second instead of minutes.
os.environ["HF_XET_CLIENT_RETRY_MAX_ATTEMPTS"] = "2"
os.environ["HF_XET_CLIENT_RETRY_BASE_DELAY"] = "10ms"
os.environ["HF_XET_CLIENT_RETRY_MAX_DURATION"] = "2s"

from fakehub import TOKEN, FakeHub

BUCKET = "lmtest/kv"
HANDLE = f"hf://buckets/{BUCKET}/cache"


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[FakeHub]:
    fake = FakeHub(tmp_path / "hub").start()
    fake.create(BUCKET)
    try:
        yield fake
    finally:
        fake.stop()


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Skip huggingface_hub's retry sleeps (1, 2, 4, 8, 8 s); returns the sleeps asked for."""
    return skip_backoff_sleeps(monkeypatch)


def skip_backoff_sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    from huggingface_hub.utils import _http

    slept: list[float] = []
    fake_time = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    fake_time.sleep = slept.append
    monkeypatch.setattr(_http, "time", fake_time)
    return slept


def bucket_bytes(hub: FakeHub) -> int:
    """Bytes of every file the fake Hub holds in the test bucket."""
    return sum(f.size for f in hub.files(BUCKET).values())


async def eventually(check: Callable[[], bool], what: str, deadline_s: float = 30.0) -> None:
    """Wait until ``check()`` holds; the deadline only detects a hang."""
    end = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


TierMaker = Callable[..., Awaitable[Any]]


@pytest.fixture
async def make_tier(hub: FakeHub, tmp_path: Path, no_backoff: list[float]) -> AsyncIterator[TierMaker]:
    from lmserver.storage.tiers.hf import HFBucketTier, Options

    made: list[Any] = []

    async def make(
        handle: str = HANDLE, *, token: str | None = TOKEN, endpoint: str | None = None, **options: Any
    ) -> HFBucketTier:
        options.setdefault("refresh_s", 0.0)
        options.setdefault("window_s", 0.01)
        tier = HFBucketTier(
            handle, token=token, endpoint=endpoint or hub.endpoint, options=Options(**options)
        )
        await tier.open()
        made.append(tier)
        return tier

    yield make
    for tier in made:
        await tier.close()
