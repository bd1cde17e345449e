"""``shard_index``: which lock shard of the memory tier a key belongs to; ``ShardLock``: its lock.

Strategy: two twins with one behaviour, as lmproto/_lookup_py.py. ``_shard_c.c`` is what a
build compiles and the selector ``_shard.py`` imports when it is there; this file is the
reference and the pure build, and tests/test_shard_twins.py compares the two.

Why C: ``hash(key) % shards`` in mypyc-compiled code boxes the hash (a 64-bit hash does not fit
mypyc's 63-bit tagged int half the time) and divides it as a Python int: 9% of a pipelined
EXIST. In C it is one machine division, and the answer is a cached small int. ``ShardLock``
is ``threading.Lock`` here; in C it is the same kind of lock with argument-less ``acquire`` and
``release`` (threading.Lock parses its optional arguments on every call: ~8% of a 4 KiB GET).
"""

from __future__ import annotations

import sys
import threading

ShardLock = threading.Lock
"""A lock: ``acquire()`` waits (without the GIL) and returns True, ``release()`` raises
RuntimeError if it is not held, ``locked()``, and ``with``. No timeout, no non-blocking acquire:
a shard's critical sections are short."""


def shard_index(key: str, shards: int) -> int:
    """``hash(key) % shards``: in ``range(shards)``. Raises ValueError unless ``shards`` is in
    ``1..sys.maxsize`` (a C ``Py_ssize_t``), TypeError if ``key`` is not hashable."""
    if not 0 < shards <= sys.maxsize:
        raise ValueError(f"shards must be in 1..{sys.maxsize}, not {shards}")
    return hash(key) % shards
