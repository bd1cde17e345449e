"""Where a NIXL tier's bytes live: files (POSIX, GDS, GDS_MT) or S3 objects (OBJ).

Strategy: both stores hold the same thing, the disk tier's self-describing object format
(``_diskfile``: magic, key, lengths, CRCs, v1 metadata, header then body), at a *location*:

* dynamic layout: the location is ``sha256(key)`` hex. Files live at
  ``<dir>/objects/<3 hex>/<sha>``, written to ``<dir>/tmp/<uuid>`` and renamed into place;
  objects at ``<prefix>objects/<sha>`` (an S3 PUT is atomic). Either way a reader sees a
  whole old object, a whole new one, or none.
* static layout: the location is a slot number. Files: one pool file ``<dir>/slots.pool``
  of ``slots x slot_size`` bytes, opened and registered once per agent; objects: keys
  ``<prefix>slots/<n>``. A slot is overwritten in place, so a torn write is possible and is
  caught by the body CRC on read (counted ``corrupt``, never served).

Data moves through NIXL from a lane's staging buffer. Listing, header probes and deletion
are metadata operations and go around NIXL (``os`` / boto3; NIXL has no delete or list).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

from .. import _diskfile
from ..errors import ConfigError, TierError
from ._agent import TransferTimeout
from ._lanes import Lane
from ._options import NixlOptions, io_length_for

Location = int | str

HEADER_PROBE = _diskfile.MAX_HEADER
_STALE_TMP_S = 3600.0
"""In shared mode a temp file is removed at open only when this old (another server may be
writing it right now)."""


class Missing(TierError):
    """The object or slot is not in the backend."""


class Unreachable(TierError):
    """The backend did not answer at open; the tier starts empty and unhealthy."""


class Corrupt(TierError):
    """The stored bytes are not a whole object (truncated, torn, overwritten)."""


class Store:
    """Interface both stores implement; every method blocks (call from a thread)."""

    def open(self) -> None: ...

    def reopen(self) -> bool:
        """After an Unreachable open: True once the backend answers."""
        return True

    def attach(self, lane: Lane) -> None:
        """Per-agent setup (registrations that last as long as the lane)."""

    def detach(self, lane: Lane) -> None: ...

    def write(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        """Store the first ``nbytes`` of the lane's staging buffer at ``loc``."""
        raise NotImplementedError

    def read(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        """Load ``nbytes`` from ``loc`` into the lane's staging buffer; Missing, Corrupt."""
        raise NotImplementedError

    def delete(self, loc: Location) -> None:
        """Remove (dynamic) or invalidate (static: a restart must not revive it)."""
        raise NotImplementedError

    def scan(self) -> Iterator[tuple[Location, bytes, int]]:
        """(location, header bytes, stored size) of everything stored, in no order."""
        raise NotImplementedError

    def probe(self, loc: Location) -> tuple[bytes, int] | None:
        """Header bytes and stored size at ``loc``, or None when absent."""
        raise NotImplementedError

    def listing(self) -> set[str]:
        """Names of the stored objects (dynamic layout), for a refresh."""
        raise NotImplementedError

    def whole(self, header: _diskfile.Header, stored: int) -> bool:
        raise NotImplementedError

    def close(self) -> None: ...


class FileStore(Store):
    def __init__(self, opts: NixlOptions) -> None:
        self.opts = opts
        self.static = opts.layout == "static"
        self._objects = os.path.join(opts.path, "objects")
        self._tmp = os.path.join(opts.path, "tmp")
        self._pool = os.path.join(opts.path, "slots.pool")
        self._lock_fd = -1
        self._io_fd = -1  # the pool file for NIXL (O_DIRECT when asked)
        self._meta_fd = -1  # the pool file for header reads and invalidation (buffered)
        self._flags = os.O_CLOEXEC | (os.O_DIRECT if opts.direct else 0)

    def open(self) -> None:
        opts = self.opts
        try:
            os.makedirs(opts.path, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"nixl tier: cannot create {opts.path}: {exc}") from None
        if not opts.shared:
            lock = os.path.join(opts.path, "lock")
            self._lock_fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self._lock_fd)
                self._lock_fd = -1
                raise ConfigError(
                    f"nixl tier directory {opts.path} is in use by another process (shared=true shares it)"
                ) from None
        if self.static:
            size = opts.slots * opts.slot_size
            self._io_fd = os.open(self._pool, os.O_RDWR | os.O_CREAT | self._flags, 0o644)
            self._meta_fd = os.open(self._pool, os.O_RDWR | os.O_CLOEXEC)
            if os.fstat(self._meta_fd).st_size != size:
                os.ftruncate(self._meta_fd, size)  # sparse: blocks are allocated on first write
        else:
            os.makedirs(self._objects, exist_ok=True)
            os.makedirs(self._tmp, exist_ok=True)
            now = time.time()
            with os.scandir(self._tmp) as it:
                for de in it:
                    if not opts.shared or now - de.stat().st_mtime > _STALE_TMP_S:
                        with contextlib.suppress(OSError):
                            os.unlink(de.path)

    def attach(self, lane: Lane) -> None:
        if self.static:
            lane.attached = lane.agent.register_file(self._io_fd)

    def detach(self, lane: Lane) -> None:
        if lane.attached is not None:
            with contextlib.suppress(TierError):
                lane.agent.deregister(lane.attached)
            lane.attached = None

    def path_of(self, name: str) -> str:
        return os.path.join(self._objects, _diskfile.object_relpath(name))

    def write(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        n = io_length_for(self.opts, nbytes)
        if self.static:
            assert isinstance(loc, int)
            remote = [(loc * self.opts.slot_size, n, self._io_fd)]
            lane.agent.transfer("WRITE", [(lane.addr, n)], remote, deadline)
            return
        assert isinstance(loc, str)
        tmp = os.path.join(self._tmp, uuid.uuid4().hex)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | self._flags, 0o644)
        try:
            self._transfer_fd(lane, "WRITE", fd, n, deadline)
            if self.opts.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        os.close(fd)
        final = self.path_of(loc)
        try:
            os.rename(tmp, final)
        except FileNotFoundError:  # first object of its fan-out directory
            os.makedirs(os.path.dirname(final), exist_ok=True)
            try:
                os.rename(tmp, final)
            except OSError:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise

    def read(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        n = io_length_for(self.opts, nbytes)
        if self.static:
            assert isinstance(loc, int)
            remote = [(loc * self.opts.slot_size, n, self._io_fd)]
            lane.agent.transfer("READ", [(lane.addr, n)], remote, deadline)
            return
        assert isinstance(loc, str)
        try:
            fd = os.open(self.path_of(loc), os.O_RDONLY | self._flags)
        except FileNotFoundError:
            raise Missing(loc) from None
        try:
            if os.fstat(fd).st_size < n:  # NIXL POSIX raises on a short read: say why
                raise Corrupt(f"file shorter than {n} bytes")
            self._transfer_fd(lane, "READ", fd, n, deadline)
        finally:
            os.close(fd)

    def _transfer_fd(self, lane: Lane, op: str, fd: int, n: int, deadline: float) -> None:
        reg = lane.agent.register_file(fd)
        try:
            lane.agent.transfer(op, [(lane.addr, n)], [(0, n, fd)], deadline)
        finally:
            lane.agent.deregister(reg)

    def delete(self, loc: Location) -> None:
        if self.static:
            assert isinstance(loc, int)
            # Overwrite the magic: a restart's scan must not bring the slot's object back.
            os.pwrite(self._meta_fd, bytes(len(_diskfile.MAGIC)), loc * self.opts.slot_size)
            return
        assert isinstance(loc, str)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_of(loc))

    def scan(self) -> Iterator[tuple[Location, bytes, int]]:
        if self.static:
            size = self.opts.slot_size
            for slot in range(self.opts.slots):
                yield slot, os.pread(self._meta_fd, HEADER_PROBE, slot * size), size
            return
        for name in self.listing():
            got = self.probe(name)
            if got is not None:
                yield name, got[0], got[1]

    def listing(self) -> set[str]:
        names: set[str] = set()
        with os.scandir(self._objects) as top:
            subdirs = [de.path for de in top if de.is_dir(follow_symlinks=False)]
        for sub in subdirs:
            with contextlib.suppress(FileNotFoundError), os.scandir(sub) as it:
                names.update(de.name for de in it)
        return names

    def probe(self, loc: Location) -> tuple[bytes, int] | None:
        if self.static:
            raise NotImplementedError("a static pool is never probed")
        assert isinstance(loc, str)
        try:
            with open(self.path_of(loc), "rb", buffering=0) as f:
                return f.read(HEADER_PROBE), os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return None

    def whole(self, header: _diskfile.Header, stored: int) -> bool:
        if self.static:
            return header.size <= self.opts.slot_size
        return stored == io_length_for(self.opts, header.size)

    def close(self) -> None:
        for fd in (self._io_fd, self._meta_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._io_fd = self._meta_fd = self._lock_fd = -1


class ObjStore(Store):
    def __init__(self, opts: NixlOptions) -> None:
        self.opts = opts
        self.static = opts.layout == "static"
        self._s3: Any = None

    def object_key(self, loc: Location) -> str:
        if self.static:
            return f"{self.opts.prefix}slots/{loc:08d}"
        return f"{self.opts.prefix}objects/{loc}"

    def open(self) -> None:
        try:
            import boto3  # only OBJ needs it
            from botocore.config import Config
        except ImportError as exc:
            raise ConfigError(
                f"nixl backend OBJ needs boto3 for listing and deletion ({exc}); pip install 'lmserver[nixl]'"
            ) from None
        opts = self.opts
        # One attempt per call, bounded like a transfer: a dead endpoint must not hold a
        # metadata thread for botocore's default minutes of retries.
        config = Config(
            connect_timeout=opts.timeout,
            read_timeout=opts.timeout,
            retries={"total_max_attempts": 1},
            s3={"addressing_style": "virtual" if opts.virtual_host else "path"},
        )
        kwargs: dict[str, Any] = {"region_name": opts.region, "config": config}
        if opts.endpoint:
            kwargs["endpoint_url"] = opts.endpoint
        if opts.access_key:
            kwargs["aws_access_key_id"] = opts.access_key
            kwargs["aws_secret_access_key"] = opts.secret_key
        self._s3 = boto3.session.Session().client("s3", **kwargs)
        try:
            self._s3.head_bucket(Bucket=opts.bucket)
        except self._s3.exceptions.ClientError as exc:  # the endpoint answered: no such bucket, denied
            raise ConfigError(f"nixl tier: bucket {opts.bucket!r}: {exc}") from None
        except Exception as exc:  # no answer: start, unhealthy, and retry loading later
            raise Unreachable(f"S3 endpoint not reachable: {exc}") from None

    def reopen(self) -> bool:
        try:
            self._s3.head_bucket(Bucket=self.opts.bucket)
        except Exception as exc:
            raise Unreachable(f"S3 endpoint not reachable: {exc}") from None
        return True

    def write(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        self._transfer(lane, "WRITE", loc, nbytes, deadline)

    def read(self, lane: Lane, loc: Location, nbytes: int, deadline: float) -> None:
        # A READ past the end of an object succeeds and leaves the tail stale: the header
        # and body checks after it catch a shorter (truncated or replaced) object.
        try:
            self._transfer(lane, "READ", loc, nbytes, deadline)
        except TransferTimeout:
            raise
        except TierError:
            # NIXL reports a missing key as a plain backend error: ask S3 which it was.
            if self.probe(loc) is None:
                raise Missing(str(loc)) from None
            raise

    def _transfer(self, lane: Lane, op: str, loc: Location, n: int, deadline: float) -> None:
        dev = lane.next_dev()
        try:
            reg = lane.agent.register_object(dev, self.object_key(loc))
        except TierError as exc:
            raise Missing(str(exc)) from None
        try:
            lane.agent.transfer(op, [(lane.addr, n)], [(0, n, dev)], deadline)
        finally:
            lane.agent.deregister(reg)

    def delete(self, loc: Location) -> None:
        try:
            self._s3.delete_object(Bucket=self.opts.bucket, Key=self.object_key(loc))
        except Exception as exc:
            raise TierError(f"S3 delete failed: {exc}") from None

    def scan(self) -> Iterator[tuple[Location, bytes, int]]:
        folder = f"{self.opts.prefix}{'slots' if self.static else 'objects'}/"
        listed: list[tuple[Location, int]] = []
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.opts.bucket, Prefix=folder)
            for page in pages:
                for item in page.get("Contents", ()):
                    name = item["Key"][len(folder) :]
                    if "/" in name:
                        continue
                    if self.static:
                        if not name.isdigit() or int(name) >= self.opts.slots:
                            continue
                        listed.append((int(name), int(item["Size"])))
                    else:
                        listed.append((name, int(item["Size"])))
        except Exception as exc:
            raise TierError(f"S3 listing failed: {exc}") from None
        for loc, size in listed:
            header = self._header(loc)
            if header is not None:
                yield loc, header, size

    def listing(self) -> set[str]:
        """Names under ``objects/`` (dynamic layout), for a refresh."""
        folder = f"{self.opts.prefix}objects/"
        names: set[str] = set()
        try:
            pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.opts.bucket, Prefix=folder)
            for page in pages:
                names.update(item["Key"][len(folder) :] for item in page.get("Contents", ()))
        except Exception as exc:
            raise TierError(f"S3 listing failed: {exc}") from None
        return names

    def _header(self, loc: Location) -> bytes | None:
        try:
            reply = self._s3.get_object(
                Bucket=self.opts.bucket, Key=self.object_key(loc), Range=f"bytes=0-{HEADER_PROBE - 1}"
            )
            return bytes(reply["Body"].read())
        except self._s3.exceptions.NoSuchKey:
            return None
        except Exception as exc:
            raise TierError(f"S3 header read failed: {exc}") from None

    def probe(self, loc: Location) -> tuple[bytes, int] | None:
        try:
            reply = self._s3.get_object(
                Bucket=self.opts.bucket, Key=self.object_key(loc), Range=f"bytes=0-{HEADER_PROBE - 1}"
            )
            body = bytes(reply["Body"].read())
        except self._s3.exceptions.NoSuchKey:
            return None
        except Exception as exc:
            raise TierError(f"S3 probe failed: {exc}") from None
        content_range = str(reply.get("ContentRange", ""))  # "bytes 0-233/1234"
        total = int(content_range.rpartition("/")[2]) if "/" in content_range else len(body)
        return body, total

    def whole(self, header: _diskfile.Header, stored: int) -> bool:
        if self.static:
            return header.size <= self.opts.slot_size and stored == header.size
        return stored == header.size

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()
            self._s3 = None


def make_store(opts: NixlOptions) -> Store:
    return ObjStore(opts) if opts.is_obj else FileStore(opts)
