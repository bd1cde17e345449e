"""lmserver: an asyncio remote KV-cache server speaking LMCache's lm:// protocol."""

# First: the compiled modules run from source if LMSERVER_PURE=1 or a stale build says so.
from . import _native

__version__ = "0.1.0"


def compiled() -> dict[str, bool]:
    """Whether each module a compiled build compiles runs compiled here (docs/building.md).

    All False: a pure-Python install, or LMSERVER_PURE=1."""
    return _native.compiled()
