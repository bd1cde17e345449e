"""The DiskTier object file format (``lmserver.tiers._diskfile``), without a tier."""

from __future__ import annotations

import os
import zlib
from pathlib import Path

import pytest

from lmproto import ObjectMeta
from lmserver.tiers import _diskfile

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
        (lambda b: b[:8] + b"\x02\x00" + b[10:], "version"),
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
