"""State shared by the server and all its connections."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .config import ServerConfig
from .store import Store

if TYPE_CHECKING:
    from .connection import LMProtocol


@dataclass
class ServerState:
    config: ServerConfig
    store: Store
    connections: set[LMProtocol] = field(default_factory=set)
    connections_per_address: Counter[str] = field(default_factory=Counter)
    counters: Counter[str] = field(default_factory=Counter)
    started_at: float = field(default_factory=time.time)
    shutting_down: bool = False
    tasks: set[asyncio.Future[object]] = field(default_factory=set)
    # Set whenever no connection is open (the shutdown waits on it).
    no_connections: asyncio.Event = field(default_factory=asyncio.Event)
