"""One client connection, in parts (protocol.py says how they fit together): ``staging``
(where received bytes go), ``replies`` (the reply queue and its flow control), ``phase``
(where the connection stands), ``handlers`` (the commands but PUT), ``sweep`` (timeouts), and
``protocol`` (``LMProtocol``, which parses, dispatches and receives PUT bodies)."""

from __future__ import annotations

from .protocol import LMProtocol
from .sweep import sweep

__all__ = ["LMProtocol", "sweep"]
