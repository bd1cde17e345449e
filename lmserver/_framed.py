"""``framed_copy``: a small GET reply (header, then a copy of the object) as one bytes object;
``send_nowait``: a reply written straight to the connection's socket.

Strategy: two twins with one behaviour, as lmproto/_lookup.py. ``_framed.c`` is what a build
compiles and Python imports when it is there; this file is the reference and the pure build,
and a test compares the two.

Why C: the memory tier copies a small object out under its shard lock, and the reply is its
header in front of those bytes. In Python that is two copies of the object (the slice out of
the mmap, then ``header + slice``) and an allocation for each; a memoryview in between costs
about what it saves at 4 KiB. The C twin allocates the reply once and copies each part once.

``send_nowait`` is how a small reply leaves when the transport has nothing queued: one
``send(2)``, as uvloop's own ``write`` starts, without the method lookup, argument parsing and
queue bookkeeping around it (~1,800 instructions of a ~7,500 instruction sequential EXIST,
whole process). ``os.write`` would do, but it releases and retakes the GIL around the call
(~1,100 instructions); the C twin keeps the GIL, as uvloop does for its writes, since a
non-blocking send never waits.
"""

from __future__ import annotations

import mmap
import os


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


def send_nowait(fd: int, data: bytes | bytearray | memoryview) -> int:
    """Write what ``data`` holds to the non-blocking socket ``fd`` with one ``send(2)``;
    returns the number of bytes sent, 0 if none could be (the socket buffer is full, the peer
    is gone, ``fd`` is closed: the caller hands the rest to the transport, which finds the same
    error and reports it). Raises ValueError unless ``0 <= fd <= 2**31 - 1``, TypeError if
    ``fd`` is not an int or ``data`` not a buffer of bytes."""
    if not isinstance(fd, int):
        raise TypeError(f"fd must be an int, not {type(fd).__name__}")
    if not 0 <= fd <= _FD_MAX:
        raise ValueError(f"fd must be in 0..{_FD_MAX}, not {fd}")
    view = memoryview(data)  # TypeError for what is not a buffer, as the C twin
    try:
        return os.write(fd, view)
    except OSError:
        return 0


_FD_MAX = 2**31 - 1
