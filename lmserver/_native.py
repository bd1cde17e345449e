"""lmserver's compiled modules, and when they run: lmproto/_native.py holds the mechanism,
docs/building.md tells the scheme. setup.py reads these two lists from this file's source.
"""

from __future__ import annotations

from lmproto import _native

MYPYC = (
    "lmserver.connection.handlers",
    "lmserver.connection.phase",
    "lmserver.connection.protocol",
    "lmserver.connection.replies",
    "lmserver.connection.staging",
    "lmserver.storage.memory",
    "lmserver.plain",
    "lmserver.storage.store",
)
"""lmserver's modules a build compiles with mypyc: the connection's parts on the request
path (parse/dispatch, staging, replies, phase, handlers), the plain
transport's read and write path, and the memory tier and store lookups a request makes."""

C_TWINS = ("lmserver._framed", "lmserver._shard")
"""lmserver's selectors of a C twin: replies and socket calls, the memory tier's shard."""

SOURCES = _native.run_from_source(MYPYC, also=_native.SOURCES)
"""Whether lmserver's mypyc modules run from source: also whenever lmproto's do, because this
compiled code calls lmproto's compiled functions directly (mypyc links the two), and would run
the old build of what lmproto's sources now say."""


def compiled() -> dict[str, bool]:
    """For each compiled module of lmproto and lmserver: whether it runs compiled here."""
    return {**_native.compiled(), **_native.status(MYPYC, C_TWINS)}
