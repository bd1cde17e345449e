"""``send_nowait``, ``recv_nowait`` and ``ReplyBuffer``, from the C twin (``_framed_c.c``) where
the build made it, else from the Python twin (``_framed_py.py``: the reference, which documents
them). ``LMSERVER_PURE=1`` picks the Python twin (lmproto/_native.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lmproto._native import use_c_twin

__all__ = ["ReplyBuffer", "recv_nowait", "send_nowait"]

COMPILED = use_c_twin(__name__)
"""Whether the C twin runs here."""

if TYPE_CHECKING or not COMPILED:
    from ._framed_py import ReplyBuffer, recv_nowait, send_nowait
else:
    from ._framed_c import ReplyBuffer, recv_nowait, send_nowait
