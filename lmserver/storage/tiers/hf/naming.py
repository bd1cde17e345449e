"""Bucket handles, object paths and the object format of the HF Buckets tier (no Hub imports).

* **Handle**, parsed exactly as LMCache's ``hf://`` adapter parses it: strip whitespace,
  require ``hf://buckets/``, drop empty path segments, need at least two: the first two are
  the bucket id ``namespace/bucket``, the rest (joined by ``/``) the object prefix.
* **Object path**: ``<prefix>/<sha256(key_utf8) hex>`` (just the hex without a prefix): never
  key text, so long, hostile or non-ASCII keys are safe and every path is 64 characters
  after the prefix. A listing tells sizes, not keys; a key is learned from the object's header.
* **Object bytes**: the disk tier's self-describing format (``_diskfile``: magic, version,
  key, lengths, CRC-32 of the body, v1 metadata, header CRC) followed by the body, so any
  instance can verify and serve what another wrote.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lmproto import ObjectMeta

from .. import _diskfile
from ..errors import ConfigError

SCHEME = "hf://buckets/"
NAME_RE = re.compile(r"^[0-9a-f]{64}$")


class Handle(NamedTuple):
    bucket_id: str
    prefix: str

    def path_of(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def name_of(self, path: str) -> str | None:
        """The object name of a bucket path this tier owns, else None (foreign files)."""
        head, _, name = path.rpartition("/")
        if head != self.prefix or not NAME_RE.match(name):
            return None
        return name

    def __str__(self) -> str:
        return SCHEME + self.bucket_id + (f"/{self.prefix}" if self.prefix else "")


def parse_handle(text: str) -> Handle:
    """``hf://buckets/<namespace>/<bucket>[/<prefix>]``; ConfigError for anything else."""
    handle = text.strip()
    if not handle.startswith(SCHEME):
        raise ConfigError(f"bucket handle {text!r}: expected hf://buckets/<namespace>/<bucket>[/<prefix>]")
    segments = [s for s in handle[len(SCHEME) :].split("/") if s]
    if len(segments) < 2:
        raise ConfigError(f"bucket handle {text!r}: needs both a namespace and a bucket name")
    if any(s in (".", "..") for s in segments):
        raise ConfigError(f"bucket handle {text!r}: '.' and '..' are not valid path segments")
    return Handle(f"{segments[0]}/{segments[1]}", "/".join(segments[2:]))


def object_name(key: str) -> str:
    return _diskfile.object_name(key.encode("utf-8"))


def encode_header(key: str, body: memoryview, meta: ObjectMeta, written_ns: int) -> tuple[bytes, int]:
    """The object's header and the body's CRC; ValueError if the key or metadata cannot be held."""
    crc = _diskfile.checksum(body)
    header = _diskfile.encode_header(key.encode("utf-8"), len(body), crc, meta, written_ns)
    return header, crc
