"""The disk tier: a persistent, capacity-bounded LRU store written as a log (``tier.py``)."""

from .tier import (
    DEFAULT_CAPACITY,
    DEFAULT_DIRECT,
    DEFAULT_FSYNC,
    DIRECT_MIN,
    DIRECT_POLICIES,
    FSYNC_POLICIES,
    HELD_SHARE,
    DirectPolicy,
    DiskTier,
)
from .writer import FsyncPolicy

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_DIRECT",
    "DEFAULT_FSYNC",
    "DIRECT_MIN",
    "DIRECT_POLICIES",
    "FSYNC_POLICIES",
    "HELD_SHARE",
    "DirectPolicy",
    "DiskTier",
    "FsyncPolicy",
]
