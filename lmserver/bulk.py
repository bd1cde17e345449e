"""DELETE_MANY and LIST_PAGE: the extension commands over many keys (SPEC 8.10, 8.11).

Strategy: each is a function of the Store and the decoded request that returns the reply
body; the connection only decodes, waits and answers (connection.py), so the two commands
live here whole. DELETE_MANY runs every key's delete at once (a tier behind memory deletes
them concurrently), so a batch of evictions costs one request, one wait and one reply
instead of one each. LIST_PAGE pages through `Store.keys` with a cursor (the last key of
the previous page) and reports each key's size where memory holds the object; a key held
only by a tier behind memory has no size known without I/O (`UNKNOWN_SIZE`).
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Sequence

from lmproto import MAX_PAGE_KEYS, UNKNOWN_SIZE, encode_page, encode_presence

from .storage.store import Store


async def delete_many(store: Store, keys: Sequence[str]) -> bytes:
    """Delete every key; the DELETE_MANY reply body (1: deleted, 0: no tier held it).

    With tiers behind memory the deletes wait for tier jobs, so they run concurrently; with
    memory alone none of them suspends, and awaiting each in turn saves a task per key."""
    if store.links:
        return encode_presence(await asyncio.gather(*(store.delete(key) for key in keys)))
    return encode_presence([await store.delete(key) for key in keys])


def list_page(store: Store, prefix: str, after: str, limit: int) -> bytes:
    """The LIST_PAGE reply body: up to ``limit`` keys (and sizes) starting with ``prefix``
    that sort after ``after``, in key order, and whether more follow."""
    keys = store.keys(prefix)
    start = bisect.bisect_right(keys, after) if after else 0
    page = keys[start : start + min(limit, MAX_PAGE_KEYS)]
    more = start + len(page) < len(keys)
    entries = []
    for key in page:
        size = store.size_in_memory(key)
        entries.append((key, UNKNOWN_SIZE if size is None else size))
    return encode_page(entries, more)
