"""``decode_lookup``, ``decode_lookups`` and ``decode_lookups_into``, from the C twin
(``_lookup_c.c``) where the build made it, else from the Python twin (``_lookup_py.py``: the
reference, which documents them). ``LMSERVER_PURE=1`` picks the Python twin (lmproto/_native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._native import use_c_twin

__all__ = ["RUN_MAX", "decode_lookup", "decode_lookups", "decode_lookups_into"]

COMPILED = use_c_twin(__name__)
"""Whether the C twin runs here."""

if TYPE_CHECKING or not COMPILED:
    from ._lookup_py import RUN_MAX, decode_lookup, decode_lookups, decode_lookups_into
else:
    from ._lookup_c import RUN_MAX, decode_lookup, decode_lookups, decode_lookups_into
