"""lmserver: an asyncio remote KV-cache server speaking LMCache's lm:// protocol."""

# First: lmproto puts LMSERVER_PURE's finder in place before any compiled module is imported.
from lmproto import _native

__version__ = "0.1.0"


def compiled() -> dict[str, bool]:
    """Whether each module a mypyc build compiles runs compiled here (see lmproto/_native.py).

    All False: a pure-Python install, or LMSERVER_PURE=1."""
    return _native.compiled()
