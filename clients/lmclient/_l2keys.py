"""The lm:// key of an LMCache multi-process ``ObjectKey`` and back (protocol/SPEC.md 5.1).

Strategy: LMCache's own key string (``model@rank@group@hash[@salt]``, what its native
connectors use) wherever it is a valid lm:// key, so a LIST by ``model@`` finds a model's
objects and they can be turned back into ObjectKeys; a fixed-length SHA-256 form where it is
not (longer than 150 bytes, surrounding whitespace, NUL, or a line feed, which LIST cannot
carry). Standard library only: the adapter (lmcache_mp) builds the ObjectKeys.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from lmproto import KEY_SIZE

HASHED_PREFIX = "lmcache-sha256@"
"""The hashed form's prefix; a native key has at least four ``@``-separated fields."""


class KeyFields(NamedTuple):
    """An ObjectKey's fields, in ObjectKey's order."""

    chunk_hash: bytes
    model_name: str
    kv_rank: int
    object_group_id: int
    cache_salt: str


def object_name(fields: KeyFields) -> str:
    """The lm:// key an object with these fields is stored under."""
    native = f"{fields.model_name}@{fields.kv_rank:08x}@{fields.object_group_id:x}@{fields.chunk_hash.hex()}"
    if fields.cache_salt:
        native += f"@{fields.cache_salt}"
    raw = native.encode("utf-8", "surrogatepass")
    if len(raw) <= KEY_SIZE and native == native.strip() and "\0" not in native and "\n" not in native:
        return native
    return HASHED_PREFIX + hashlib.sha256(raw).hexdigest()


def parse_name(name: str) -> KeyFields | None:
    """The fields of a native-form key; None for a hashed key or anything else."""
    if name.startswith(HASHED_PREFIX):
        return None
    parts = name.split("@")
    if len(parts) not in (4, 5):
        return None
    model, rank, group, digest = parts[:4]
    try:
        return KeyFields(bytes.fromhex(digest), model, int(rank, 16), int(group, 16), "".join(parts[4:]))
    except ValueError:
        return None
