"""The fake Hub's storage service: the Xet CAS protocol over HTTP, as hf_xet's ``RemoteClient``
speaks it to the real Hub's storage, so any number of processes share one bucket's bytes.

What hf_xet sends (xet-core's ``remote_client.rs``, and its own ``local_server`` simulation of
the service, read for this):

- **Auth**: every CAS request carries ``Authorization: Bearer <accessToken>``; the token and
  its expiry come from the Hub's ``xet-{read,write}-token`` route (JSON ``accessToken``,
  ``exp``, ``casUrl``), and hf_xet calls that route again from 30 s before ``exp``. An unknown
  or expired token gets 401.
- **Upload**: ``POST /v1/xorb-grants/{prefix}/{hash}`` with the serialized length asks for an
  upload grant (201: ``id``, ``method``, ``url``, ``headers``; 200: the xorb exists); the
  client sends the serialized xorb (chunks, then a footer) to that URL with no CAS
  credentials (on the real Hub a presigned URL), then ``POST
  /v1/xorb-commits/{prefix}/{hash}/grant/{id}`` stores it (404: nothing was uploaded). A 404
  on the grant makes hf_xet upload through ``POST /v1/xorbs/{prefix}/{hash}`` instead.
  Then ``POST /v2/shards`` (an NDJSON progress stream ending in a ``result`` frame; a 404
  falls back to ``POST /v1/shards``) with the MDB shard that names each new file's
  segments. ``GET /v1/chunks/{prefix}/{hash}`` (global dedup) answers 404 here: nothing is
  deduplicated against other uploads. The grant's CRC-64/NVME checksum is not verified.
- **Download**: ``GET /v2/reconstructions/{file}`` (falls back to ``/v1`` on 404), with an
  optional ``Range: bytes=a-b`` over the file, answers the terms (xorb, chunk range, length)
  and where to fetch each xorb range; the client then GETs that URL with ``Range`` over the
  serialized xorb (no CAS credentials: on the real Hub it is a presigned URL). A range past
  the end answers 416, which the client takes as an empty result.

Formats (xet-core ``xet_core_structures``): an MDB shard is a 48-byte header, then the file
info section: per file a 48-byte header (hash, flags, segment count), its segments (xorb
hash, flags, unpacked bytes, chunk start, chunk end: 48 bytes each), then as many 48-byte
verification entries when flag bit 31 is set and one 48-byte metadata entry when bit 30 is
set; a header whose hash is all ones ends the section. A serialized xorb is its chunks, each
an 8-byte header (version, compressed length: 3 bytes LE, scheme, uncompressed length: 3 bytes
LE) and the compressed bytes, then a footer starting with ``XETBLOB``. Hashes print as four
64-bit words, each stored little-endian and printed big-endian.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

ENTRY = 48
BOOKEND = b"\xff" * 32
WITH_VERIFICATION = 1 << 31
WITH_METADATA_EXT = 1 << 30
SHARD_TAG = b"HFRepoMetaData\x00UigEj{\x81W\x83\xa5\xbd\xd9\\\xcd\xd1J\xa9"
FOOTER_IDENT = b"XETBLOB"
CHUNK_HEADER = 8

# route name -> (method, regex over the path after the CAS prefix)
CAS_ROUTES: dict[str, tuple[str, re.Pattern[str]]] = {
    "cas-xorb-grant": ("POST", re.compile(r"^/v1/xorb-grants/(?P<prefix>[^/]+)/(?P<hash>[0-9a-f]{64})$")),
    "cas-grant-upload": ("PUT", re.compile(r"^/grant-uploads/(?P<grant>[0-9a-f]{32})$")),
    "cas-xorb-commit": (
        "POST",
        re.compile(
            r"^/v1/xorb-commits/(?P<prefix>[^/]+)/(?P<hash>[0-9a-f]{64})/grant/(?P<grant>[0-9a-f]{32})$"
        ),
    ),
    "cas-xorb": ("POST", re.compile(r"^/v1/xorbs/(?P<prefix>[^/]+)/(?P<hash>[0-9a-f]{64})$")),
    "cas-shard": ("POST", re.compile(r"^/v(?P<version>[12])/shards$")),
    "cas-dedup": ("GET", re.compile(r"^/v1/chunks/(?P<prefix>[^/]+)/(?P<hash>[0-9a-f]{64})$")),
    "cas-reconstruction": (
        "GET",
        re.compile(r"^/v(?P<version>[12])/reconstructions/(?P<hash>[0-9a-f]{64})$"),
    ),
    "cas-fetch": ("GET", re.compile(r"^/fetch/(?P<hash>[0-9a-f]{64})$")),
}

GRANT_ROUTES = ("cas-xorb-grant", "cas-grant-upload", "cas-xorb-commit")


def hash_hex(raw: bytes) -> str:
    return "".join(f"{int.from_bytes(raw[i : i + 8], 'little'):016x}" for i in range(0, 32, 8))


class FormatError(ValueError):
    """A shard or xorb that is not what hf_xet writes."""


@dataclass(frozen=True)
class Segment:
    xorb: str
    unpacked: int
    chunk_start: int
    chunk_end: int


def parse_shard_files(data: bytes) -> dict[str, list[Segment]]:
    """File hash -> its segments, from an MDB shard's file info section."""
    if len(data) < ENTRY or data[:32] != SHARD_TAG:
        raise FormatError("not an MDB shard (wrong magic)")
    files: dict[str, list[Segment]] = {}
    at = ENTRY
    while True:
        if at + ENTRY > len(data):
            raise FormatError("shard file section has no bookend")
        raw_hash = data[at : at + 32]
        if raw_hash == BOOKEND:
            return files
        flags, count = struct.unpack_from("<II", data, at + 32)
        at += ENTRY
        end = at + ENTRY * count
        if end > len(data):
            raise FormatError("shard file entry runs past the end")
        segments = []
        for k in range(count):
            base = at + ENTRY * k
            _xflags, unpacked, start, stop = struct.unpack_from("<IIII", data, base + 32)
            if stop <= start:
                raise FormatError("empty chunk range in a shard segment")
            segments.append(Segment(hash_hex(data[base : base + 32]), unpacked, start, stop))
        at = end
        if flags & WITH_VERIFICATION:
            at += ENTRY * count
        if flags & WITH_METADATA_EXT:
            at += ENTRY
        files[hash_hex(raw_hash)] = segments


@dataclass(frozen=True)
class XorbLayout:
    """Where each chunk of a serialized xorb starts, and its uncompressed length."""

    offsets: tuple[int, ...]  # len(chunks) + 1 entries: the last is where the chunks end
    lengths: tuple[int, ...]


def parse_xorb_layout(data: bytes) -> XorbLayout:
    offsets = [0]
    lengths = []
    at = 0
    while at < len(data) and data[at : at + len(FOOTER_IDENT)] != FOOTER_IDENT:
        if at + CHUNK_HEADER > len(data):
            raise FormatError("truncated xorb chunk header")
        version = data[at]
        compressed = int.from_bytes(data[at + 1 : at + 4], "little")
        uncompressed = int.from_bytes(data[at + 5 : at + 8], "little")
        if version != 0 or at + CHUNK_HEADER + compressed > len(data):
            raise FormatError("bad xorb chunk header")
        at += CHUNK_HEADER + compressed
        offsets.append(at)
        lengths.append(uncompressed)
    if not lengths:
        raise FormatError("a xorb without chunks")
    return XorbLayout(tuple(offsets), tuple(lengths))


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, with overlapping and touching chunk ranges joined: a file that repeats its own
    chunks names one xorb range many times, and the client looks each term up in exactly
    one fetch range that covers it (xet-core's service merges the same way)."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


class RangeNotSatisfiable(ValueError):
    """A range outside the file or xorb, or of a form not served here (HTTP 416)."""


@dataclass
class _Grant:
    xorb: str
    length: int
    data: bytes | None = None


class CasStore:
    """Xorbs (files under ``root``, written whole then renamed into place) and the files the
    uploaded shards describe (in memory). Thread-safe: the HTTP server runs one thread per
    connection."""

    def __init__(self, root: pathlib.Path, *, token_ttl_s: float = 3600.0) -> None:
        self.root = root
        self.xorb_dir = root / "xorbs"
        self.xorb_dir.mkdir(parents=True, exist_ok=True)
        self.token_ttl_s = token_ttl_s
        self._lock = threading.Lock()
        self._layouts: dict[str, XorbLayout] = {}
        self._files: dict[str, list[Segment]] = {}
        self._tokens: dict[str, float] = {}  # access token -> expiry (unix time)
        self._grants: dict[str, _Grant] = {}
        self.tokens_issued = 0
        self.rejected_tokens = 0

    # -- tokens ----------------------------------------------------------------------------

    def issue_token(self) -> tuple[str, int]:
        token = secrets.token_urlsafe(16)
        exp = int(time.time() + self.token_ttl_s)
        with self._lock:
            self._tokens = {t: e for t, e in self._tokens.items() if e > time.time()}
            self._tokens[token] = exp
            self.tokens_issued += 1
        return token, exp

    def token_valid(self, authorization: str | None) -> bool:
        token = (authorization or "").removeprefix("Bearer ")
        with self._lock:
            ok = self._tokens.get(token, 0.0) > time.time()
            self.rejected_tokens += not ok
        return ok

    # -- writes ----------------------------------------------------------------------------

    def grant(self, xorb: str, length: int) -> str | None:
        """An upload grant for a xorb of ``length`` bytes; None when the xorb is stored already."""
        with self._lock:
            if xorb in self._layouts:
                return None
            grant = secrets.token_hex(16)
            self._grants[grant] = _Grant(xorb, length)
        return grant

    def upload_to_grant(self, grant: str, data: bytes) -> int:
        """HTTP status of an upload to a grant's URL: 200, 403 (no such grant), 412 (already
        uploaded), 400 (not the length granted)."""
        with self._lock:
            entry = self._grants.get(grant)
            if entry is None:
                return 403
            if entry.data is not None:
                return 412
            if len(data) != entry.length:
                return 400
            entry.data = data
        return 200

    def commit_grant(self, xorb: str, grant: str) -> bool:
        """Store what was uploaded to the grant; False if nothing was (the client then asks
        for a new grant). FormatError: the upload is not a xorb."""
        with self._lock:
            entry = self._grants.pop(grant, None)
        if entry is None or entry.xorb != xorb or entry.data is None:
            return False
        self.put_xorb(xorb, entry.data)
        return True

    def put_xorb(self, xorb: str, data: bytes) -> bool:
        """Store a serialized xorb; False if it was already there (the bytes of a hash never
        change, so the first copy stays)."""
        layout = parse_xorb_layout(data)
        path = self.xorb_dir / xorb
        with self._lock:
            if xorb in self._layouts:
                return False
        tmp = path.with_name(f".{xorb}.{threading.get_ident()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        with self._lock:
            self._layouts[xorb] = layout
        return True

    def put_shard(self, data: bytes) -> int:
        """Register the files a shard describes; every xorb they use must be stored already
        (hf_xet uploads xorbs before the shard that names them). Returns the file count."""
        files = parse_shard_files(data)
        with self._lock:
            for segments in files.values():
                for seg in segments:
                    layout = self._layouts.get(seg.xorb)
                    if layout is None:
                        raise FormatError(f"shard names xorb {seg.xorb}, never uploaded")
                    if seg.chunk_end > len(layout.lengths):
                        raise FormatError("shard segment past the end of its xorb")
            self._files.update(files)
        return len(files)

    # -- reads -----------------------------------------------------------------------------

    def file_size(self, file_hash: str) -> int | None:
        with self._lock:
            segments = self._files.get(file_hash)
        return None if segments is None else sum(s.unpacked for s in segments)

    def reconstruction(
        self, file_hash: str, first: int | None, last: int | None, base_url: str
    ) -> dict[str, Any]:
        """The v1 reconstruction of bytes ``first..last`` (inclusive; None: the whole file),
        trimmed to whole chunks as xet-core's own service does. KeyError: unknown file."""
        with self._lock:
            segments = self._files[file_hash]
            layouts = {s.xorb: self._layouts[s.xorb] for s in segments}
        size = sum(s.unpacked for s in segments)
        start = 0 if first is None else first
        end = size if last is None else min(last + 1, size)
        if size == 0 or start >= size:
            if start == 0 and size == 0:
                return {"offset_into_first_range": 0, "terms": [], "fetch_info": {}}
            raise RangeNotSatisfiable
        terms: list[dict[str, Any]] = []
        wanted: dict[str, list[tuple[int, int]]] = {}  # xorb -> chunk ranges the terms use
        pos = 0  # file offset where the current segment starts
        offset_into_first: int | None = None
        for seg in segments:
            seg_end = pos + seg.unpacked
            if seg_end <= start or pos >= end:
                pos = seg_end
                continue
            lengths = layouts[seg.xorb].lengths
            lo, hi, here = seg.chunk_start, seg.chunk_end, pos
            while here + lengths[lo] <= start:  # drop whole chunks before the range
                here += lengths[lo]
                lo += 1
            tail = seg_end
            while tail - lengths[hi - 1] >= end:  # and after it
                tail -= lengths[hi - 1]
                hi -= 1
            if offset_into_first is None:
                offset_into_first = start - here
            chunks = {"start": lo, "end": hi}
            terms.append({"hash": seg.xorb, "unpacked_length": tail - here, "range": chunks})
            wanted.setdefault(seg.xorb, []).append((lo, hi))
            pos = seg_end
        fetch = {
            xorb: [
                {
                    "range": {"start": lo, "end": hi},
                    "url": f"{base_url}/fetch/{xorb}",
                    "url_range": {"start": layouts[xorb].offsets[lo], "end": layouts[xorb].offsets[hi] - 1},
                }
                for lo, hi in merge_ranges(ranges)
            ]
            for xorb, ranges in wanted.items()
        }
        return {"offset_into_first_range": offset_into_first or 0, "terms": terms, "fetch_info": fetch}

    def read_xorb(self, xorb: str, first: int, last: int) -> bytes:
        """Bytes ``first..last`` (inclusive) of a serialized xorb. KeyError: unknown xorb."""
        with self._lock:
            if xorb not in self._layouts:
                raise KeyError(xorb)
        if first >= (self.xorb_dir / xorb).stat().st_size:
            raise RangeNotSatisfiable
        with open(self.xorb_dir / xorb, "rb") as f:
            f.seek(first)
            return f.read(last - first + 1)


def as_v2(v1: dict[str, Any]) -> dict[str, Any]:
    """The v2 reconstruction of a v1 one: one fetch per range (xet-core's own conversion)."""
    xorbs = {
        xorb: [{"url": f["url"], "ranges": [{"chunks": f["range"], "bytes": f["url_range"]}]} for f in got]
        for xorb, got in v1["fetch_info"].items()
    }
    return {"offset_into_first_range": v1["offset_into_first_range"], "terms": v1["terms"], "xorbs": xorbs}


SHARD_V2_EVENTS = b"".join(
    json.dumps(event).encode() + b"\n"
    for event in (
        {"type": "validating", "verified": 1, "total": 1},
        {"type": "committing", "stage": "uploading"},
        {"type": "committing", "stage": "syncing"},
        {"type": "result"},
    )
)


def parse_range(header: str | None) -> tuple[int, int | None] | None:
    """``bytes=a-b`` or ``bytes=a-`` -> (a, b or None); None when absent. RangeNotSatisfiable
    otherwise (suffix and multi-range forms are never sent for what this service hands out)."""
    if header is None:
        return None
    match = re.fullmatch(r"bytes=(\d+)-(\d*)", header.strip())
    if match is None:
        raise RangeNotSatisfiable(f"unsupported range {header!r}")
    first = int(match.group(1))
    last = int(match.group(2)) if match.group(2) else None
    if last is not None and last < first:
        raise RangeNotSatisfiable(f"empty range {header!r}")
    return first, last
