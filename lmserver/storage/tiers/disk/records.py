"""What the disk tier knows of one stored object, and how it reads records back.

A record is ``header + body`` (``_diskfile``'s self-describing header: magic, key, lengths,
CRC-32s, v1 metadata, write time) at an ``ALIGN``-aligned offset of a segment, padded to
``ALIGN`` so that its blocks are its own: punching them out frees exactly its space. The
header itself is padded to ``ALIGN`` when the body is written with O_DIRECT straight from
memory (the body must start on a block boundary); small records are packed header-then-body.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from lmproto import ObjectMeta

from .._diskfile import ALIGN, MAGIC, MAX_HEADER, CorruptFile, Header, checksum, decode_header


class Record(NamedTuple):
    """One indexed object. Compared by identity: a newer version is a new Record."""

    segment: int
    offset: int
    size: int  # bytes it occupies in its segment (padded to ALIGN): what capacity counts
    header_len: int
    body_len: int
    crc: int
    meta: ObjectMeta


def record_size(header_len: int, body_len: int) -> int:
    return -(-(header_len + body_len) // ALIGN) * ALIGN


def from_header(segment: int, offset: int, header: Header) -> Record:
    return Record(
        segment,
        offset,
        record_size(header.header_len, header.body_len),
        header.header_len,
        header.body_len,
        header.body_crc,
        header.meta,
    )


def read_header(fd: int, offset: int, end: int) -> Header:
    """The header of the record at ``offset`` (checked, body not read). Raises CorruptFile
    (no whole header there: a hole, a torn write, other bytes) or OSError."""
    buf = os.pread(fd, ALIGN, offset)
    try:
        header = decode_header(buf)
    except CorruptFile:
        if len(buf) < ALIGN or not _needs_more(buf):
            raise
        header = decode_header(os.pread(fd, MAX_HEADER, offset))  # a long key
    if offset + record_size(header.header_len, header.body_len) > end:
        raise CorruptFile("record runs past the end of its segment")
    return header


def _needs_more(buf: bytes) -> bool:
    """A header longer than one block (a key near MAX_KEY_BYTES) fails to decode from its
    first block; try again with more only if the magic says a header starts here."""
    return buf[: len(MAGIC)] == MAGIC


def read_into(fd: int, record: Record, header_buf: bytearray, body: memoryview) -> int:
    """Read the record's header into ``header_buf`` and its body into ``body``; returns the
    bytes read (short only at the end of the file). One ``preadv`` for both when it can."""
    want = len(header_buf) + len(body)
    got = os.preadv(fd, [header_buf, body], record.offset)
    while got < want:
        if got < len(header_buf):
            n = os.preadv(fd, [memoryview(header_buf)[got:], body], record.offset + got)
        else:
            n = os.preadv(fd, [body[got - len(header_buf) :]], record.offset + got)
        if n == 0:
            break
        got += n
    return got


def read_checked(fd: int, record: Record, key: str, body: memoryview) -> str | None:
    """Read ``record`` (``key``'s) into ``body`` and check it whole: None when it is, else
    why not: ``"missing"`` (a hole: its blocks were given back) or ``"corrupt"`` (a header
    that is not this record's, a short read, a body that fails its CRC). Raises OSError."""
    header_buf = bytearray(record.header_len)
    got = read_into(fd, record, header_buf, body)
    try:
        header = decode_header(header_buf)
    except CorruptFile:
        return "corrupt" if any(header_buf) else "missing"
    expected = (key, record.header_len, record.body_len, record.crc, record.meta)
    if (
        got != record.header_len + record.body_len
        or (header.key, header.header_len, header.body_len, header.body_crc, header.meta) != expected
        or checksum(body) != record.crc
    ):
        return "corrupt"
    return None
