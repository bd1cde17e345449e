"""The DiskTier object file format (``lmserver.storage.tiers._diskfile``), without a tier."""

from __future__ import annotations

import mmap
import os
import zlib
from pathlib import Path

import pytest

from lmproto import ObjectMeta
from lmserver.storage.tiers import _diskfile

META = ObjectMeta(fmt=1, dtype=3, shape=(2, 16, 256, 128), location=1)


def make(key: str, body: bytes, meta: ObjectMeta = META) -> bytes:
    header = _diskfile.encode_header(key.encode(), len(body), _diskfile.checksum(body), meta, 123)
    return header + body


def test_checksum_is_zlib_crc32_whichever_implementation() -> None:
    data = os.urandom(1 << 20)
    assert _diskfile.checksum(data) == zlib.crc32(data)
    assert _diskfile.checksum(memoryview(data)[7:5000]) == zlib.crc32(data[7:5000])
    assert _diskfile.checksum(b"") == 0


def test_header_round_trip_and_layout() -> None:
    key = "model@8@3@deadbeef@bfloat16/€"
    raw = make(key, b"body")
    h = _diskfile.decode_header(raw)
    assert h.key == key and h.meta == META and h.body_len == 4 and h.written_ns == 123
    assert h.body_crc == zlib.crc32(b"body")
    assert h.header_len == 84 + len(key.encode()) == len(raw) - 4
    assert raw[:8] == _diskfile.MAGIC and raw[h.header_len :] == b"body"
    assert _diskfile.FIXED_SIZE == 80


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b"X" + b[1:], "magic"),
        (lambda b: b[:8] + b"\x03\x00" + b[10:], "version"),
        (lambda b: b[:10] + b"\xff\x00" + b[12:], "length"),
        (lambda b: b[:90] + bytes([b[90] ^ 1]) + b[91:], "checksum"),
        (lambda b: b[:50], "length|shorter"),
    ],
)
def test_damaged_headers_are_rejected(mutate: object, reason: str) -> None:
    raw = make("some-key-of-reasonable-length", b"payload")
    with pytest.raises(_diskfile.CorruptFile, match=reason):
        _diskfile.decode_header(mutate(raw))  # type: ignore[operator]


def test_out_of_range_metadata_and_long_keys_refused() -> None:
    with pytest.raises(ValueError):
        _diskfile.encode_header(b"k", 1, 0, ObjectMeta(fmt=2**31), 0)
    with pytest.raises(ValueError):
        _diskfile.encode_header(b"k" * (_diskfile.MAX_KEY_BYTES + 1), 1, 0, META, 0)


def test_read_header_at_checks_file_size(tmp_path: Path) -> None:
    p = tmp_path / "obj"
    p.write_bytes(make("k", b"0123456789"))
    header, size = _diskfile.read_header_at(str(p))
    assert header.key == "k" and size == header.size
    p.write_bytes(make("k", b"0123456789") + b"extra")
    with pytest.raises(_diskfile.CorruptFile, match="bytes"):
        _diskfile.read_header_at(str(p))


def test_names_are_hashes_never_key_text() -> None:
    name = _diskfile.object_name(b"../../etc/passwd")
    assert len(name) == 64 and all(c in "0123456789abcdef" for c in name)
    assert _diskfile.object_relpath(name) == f"{name[:3]}/{name}"


# -- version 2: headers padded for direct I/O ------------------------------------------------


def aligned_body(data: bytes) -> memoryview:
    """``data`` in an anonymous mmap (page-aligned, writable), as memory-tier objects are."""
    buf = mmap.mmap(-1, max(len(data), 1))
    buf[: len(data)] = data
    return memoryview(buf)[: len(data)]


def test_padded_header_round_trip() -> None:
    header = _diskfile.encode_header(b"key", 7, 0, META, 5, align=_diskfile.ALIGN)
    assert len(header) == _diskfile.ALIGN and header[8:10] == b"\x02\x00"  # version 2
    h = _diskfile.decode_header(header)
    assert h.header_len == _diskfile.ALIGN and h.key == "key" and h.body_len == 7
    # Only the unpadded part is needed to parse it (a probe may read less than the padding).
    assert _diskfile.decode_header(header[: 84 + 3]).header_len == _diskfile.ALIGN
    # Unpadded headers are still version 1, byte for byte what older servers wrote.
    assert _diskfile.encode_header(b"key", 7, 0, META, 5)[8:10] == b"\x01\x00"
    longest = _diskfile.encode_header(b"k" * _diskfile.MAX_KEY_BYTES, 0, 0, META, 0, align=_diskfile.ALIGN)
    assert len(longest) == _diskfile.MAX_HEADER


def test_a_version_1_header_may_not_claim_padding() -> None:
    raw = bytearray(_diskfile.encode_header(b"key", 7, 0, META, 5, align=_diskfile.ALIGN))
    raw[8:10] = b"\x01\x00"  # version 1 with header_len 4096: the length check refuses it
    with pytest.raises(_diskfile.CorruptFile, match="length"):
        _diskfile.decode_header(bytes(raw))


def test_aligned_accepts_only_writable_page_aligned_views() -> None:
    body = aligned_body(b"x" * 10_000)
    assert _diskfile.aligned(body)
    assert not _diskfile.aligned(body[1:])  # off a block boundary
    assert not _diskfile.aligned(memoryview(b"x" * 10_000))  # read-only: address unknown
    assert not _diskfile.aligned(body[:0])


@pytest.mark.parametrize("size", [4096, 65536, 65536 + 123, (1 << 20) + 1])
def test_direct_write_gives_the_exact_file(tmp_path: Path, size: int) -> None:
    if not _diskfile.direct_io_works(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT")
    data = os.urandom(size)
    body = aligned_body(data)
    header = _diskfile.encode_header(b"key", size, _diskfile.checksum(data), META, 1, align=_diskfile.ALIGN)
    path = tmp_path / "obj"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        _diskfile.write_object(fd, header, body, direct=True)
    finally:
        os.close(fd)
    h, file_size = _diskfile.read_header_at(str(path))
    assert file_size == h.size == _diskfile.ALIGN + size  # the last block's padding is cut off
    raw = path.read_bytes()
    assert raw[h.header_len :] == data and zlib.crc32(raw[h.header_len :]) == h.body_crc


def test_direct_io_probe(tmp_path: Path) -> None:
    assert _diskfile.direct_io_works(str(tmp_path)) in (True, False)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert not _diskfile.direct_io_works(str(tmp_path / "missing"))
