"""``shard_index`` and ``ShardLock``, from the C twin (``_shard_c.c``) where the build made it,
else from the Python twin (``_shard_py.py``: the reference, which documents them).
``LMSERVER_PURE=1`` picks the Python twin (lmproto/_native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmproto._native import use_c_twin

__all__ = ["ShardLock", "shard_index"]

COMPILED = use_c_twin(__name__)
"""Whether the C twin runs here."""

if TYPE_CHECKING or not COMPILED:
    from ._shard_py import ShardLock, shard_index
else:
    from ._shard_c import ShardLock, shard_index
