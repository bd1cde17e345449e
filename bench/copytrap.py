"""A copy's cost against where its destination lies past its source: ``python -m bench.copytrap``.

glibc copies a few KiB and more with ``rep movsb``, which on many x86 CPUs runs 10 to 30
times slower when the destination lies 1 to 31 bytes past the source modulo 4 KiB. A GET reply
puts the object behind an 8-byte header, and pool slots are page-aligned, so that was where
every reply of 2 KiB or more landed. This times, for a few such offsets (``ahead``), glibc's
``memcpy`` (a memoryview slice assignment, which calls it; the call adds the same ~100 ns to
every row) and ``ReplyBuffer.add_framed`` of the installed build (whose C twin copies
backwards in that window; its buffer is page-aligned and starts over after ``take``, so the
object lands the header's 8 bytes past a page boundary). Best of five rounds per cell,
nanoseconds per copy.
"""

from __future__ import annotations

import argparse
import mmap
import struct
import time
from collections.abc import Callable

from lmserver._framed import ReplyBuffer

AHEADS = (0, 8, 16, 24, 32, 64, 2048)
SIZES = (2048, 4096, 16384)
HEADER = 8  # a v0 reply's status and length


def _best(copy: Callable[[], object], copies: int) -> float:
    """Nanoseconds per call of ``copy``, the best of five rounds of ``copies`` calls."""
    best = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(copies):
            copy()
        best = min(best, (time.perf_counter() - started) / copies)
    return best * 1e9


def measure(copies: int) -> list[tuple[int, int, float, float]]:
    """(size, ahead, ns per memcpy, ns per add_framed + take) for every size and ahead."""
    page = mmap.PAGESIZE
    source = mmap.mmap(-1, 2 * page + max(SIZES))
    target = mmap.mmap(-1, 2 * page + max(SIZES))
    source.write(bytes(range(256)) * (len(source) // 256))
    replies = ReplyBuffer()
    rows = []
    try:
        for size in SIZES:
            header = struct.pack("<ii", 200, size)
            for ahead in AHEADS:
                # memcpy: the source at a page boundary, the destination `ahead` past one.
                to, whole = memoryview(target)[ahead : ahead + size], memoryview(source)[:size]

                def copy(to: memoryview = to, whole: memoryview = whole) -> None:
                    to[:] = whole

                copied = _best(copy, copies)
                to.release()
                whole.release()
                # add_framed: the object lands HEADER past a page boundary, so its source lies
                # `ahead` before that.
                at = (HEADER - ahead) % page
                body = memoryview(source)[at : at + size]

                def framed(body: memoryview = body, header: bytes = header) -> None:
                    replies.add_framed(header, body)
                    replies.take()

                rows.append((size, ahead, copied, _best(framed, copies)))
                body.release()
    finally:
        replies.release()
        source.close()
        target.close()
    return rows


def format_rows(rows: list[tuple[int, int, float, float]]) -> str:
    lines = [
        "| size | ahead | memcpy ns | add_framed + take ns |",
        "|---|---|---|---|",
    ]
    lines += [f"| {size} | {ahead} | {copied:,.0f} | {framed:,.0f} |" for size, ahead, copied, framed in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--copies", type=int, default=50_000, help="per round (five rounds per cell)")
    args = parser.parse_args(argv)
    print(format_rows(measure(args.copies)))


if __name__ == "__main__":
    main()
