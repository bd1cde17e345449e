"""The Hugging Face Buckets tier (``--tier hf://buckets/<namespace>/<bucket>[/<prefix>]``).

Only ``client`` imports ``huggingface_hub``; it is imported when a tier opens, so this
package (and a bad handle's error) needs no extra installed.
"""

from .naming import Handle, parse_handle
from .options import Options
from .tier import HFBucketTier, HFVictim

__all__ = ["HFBucketTier", "HFVictim", "Handle", "Options", "parse_handle"]
