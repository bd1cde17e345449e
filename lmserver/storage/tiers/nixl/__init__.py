"""The NIXL tier: spill to NVMe and parallel file systems (POSIX, GDS, GDS_MT) or S3-compatible
object stores (OBJ) through NVIDIA's NIXL. ``--tier nixl:...``; see docs/tiers.md ("The NIXL tier").

Only ``_agent.load_api`` imports nixl, when a tier is built, so this package imports (and
type-checks) without the ``nixl`` extra installed.
"""

from .tier import NixlTier

__all__ = ["NixlTier"]
