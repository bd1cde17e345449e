"""``framed_copy``: a small GET reply (header, then a copy of the object) as one bytes object.

Strategy: two twins with one behaviour, as lmproto/_lookup.py. ``_framed.c`` is what a build
compiles and Python imports when it is there; this file is the reference and the pure build,
and a test compares the two.

Why C: the memory tier copies a small object out under its shard lock, and the reply is its
header in front of those bytes. In Python that is two copies of the object (the slice out of
the mmap, then ``header + slice``) and an allocation for each; a memoryview in between costs
about what it saves at 4 KiB. The C twin allocates the reply once and copies each part once.
"""

from __future__ import annotations

import mmap


def framed_copy(header: bytes, buffer: bytes | bytearray | memoryview | mmap.mmap, length: int) -> bytes:
    """``header + bytes(buffer[:length])``, one new bytes object. Raises ValueError unless
    ``0 <= length <= len(buffer)``; TypeError if ``header`` is not bytes or ``buffer`` not a
    buffer of bytes."""
    if not isinstance(header, bytes):
        raise TypeError(f"header must be bytes, not {type(header).__name__}")
    size = len(memoryview(buffer))  # in bytes, whatever the buffer's type
    if not 0 <= length <= size:
        raise ValueError(f"length must be in 0..{size}, not {length}")
    return header + buffer[:length]
