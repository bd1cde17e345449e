"""The NIXL tier's ``--tier nixl:...`` options, parsed and checked without importing nixl.

Targets: a directory (``nixl:/mnt/nvme/lms``) for the file backends, or an S3 bucket and
key prefix (``nixl:s3://bucket/prefix``) for OBJ. Every option is documented in docs/tiers.md
("The NIXL tier"); this module turns them into one frozen ``NixlOptions``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from ....sizes import MAX_SIZE
from ..errors import ConfigError
from ..spec import TierSpec

Backend = Literal["POSIX", "GDS", "GDS_MT", "OBJ"]
BACKENDS: tuple[Backend, ...] = ("POSIX", "GDS", "GDS_MT", "OBJ")
Layout = Literal["dynamic", "static"]
LAYOUTS: tuple[Layout, ...] = ("dynamic", "static")

ALIGN = 4096
"""O_DIRECT alignment of addresses, lengths and offsets (512 works on this machine's ext4;
4096 is right on every device)."""
DEFAULT_SLOT_SIZE = 4 << 20
DEFAULT_MAX_OBJECT = 64 << 20
DEFAULT_TIMEOUT_S = 10.0
DEFAULT_REFRESH_S = 10.0
PARAM_PREFIX = "nixl."


@dataclass(frozen=True)
class NixlOptions:
    backend: Backend
    layout: Layout
    path: str  # directory (file backends) or "" (OBJ)
    bucket: str  # OBJ only
    prefix: str  # OBJ key prefix, "" or ending in "/"
    capacity: int
    slot_size: int  # static layout: bytes per slot (header + body must fit)
    slots: int
    max_object: int  # largest header + body one lane stages (dynamic); slot_size (static)
    direct: bool
    fsync: bool
    lanes: int
    timeout: float
    shared: bool
    refresh: float  # seconds between index refreshes from a listing (0: never)
    probe: bool  # a GET that misses the index looks in the backend
    endpoint: str
    region: str
    access_key: str
    secret_key: str
    virtual_host: bool
    params: tuple[tuple[str, str], ...]  # passed to create_backend as they are
    name: str

    @property
    def is_obj(self) -> bool:
        return self.backend == "OBJ"

    @property
    def staging_bytes(self) -> int:
        """One lane's registered staging buffer: the largest transfer it makes."""
        return _round_up(self.max_object, ALIGN)

    def where(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.is_obj else self.path


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def io_length_for(opts: NixlOptions, nbytes: int) -> int:
    """Bytes a transfer moves for an object of ``nbytes``: O_DIRECT moves whole blocks."""
    return _round_up(nbytes, ALIGN) if opts.direct else nbytes


def parse(spec: TierSpec) -> NixlOptions:
    """Read every nixl option from ``spec``; ConfigError for anything wrong."""
    target = spec.target
    is_s3 = target.startswith("s3://")
    default_backend: Backend = "OBJ" if is_s3 else "POSIX"
    backend = spec.choice("backend", BACKENDS, default_backend)
    if not target or target in ("s3://", "/"):
        raise ConfigError(f"tier {spec}: expected a directory or s3://BUCKET/PREFIX after 'nixl:'")
    bucket = prefix = path = ""
    if backend == "OBJ":
        if not is_s3:
            raise ConfigError(f"tier {spec}: backend OBJ needs a target s3://BUCKET/PREFIX")
        bucket, _, prefix = target[len("s3://") :].partition("/")
        if not bucket:
            raise ConfigError(f"tier {spec}: no bucket in {target!r}")
        prefix = prefix.strip("/")
        prefix = prefix + "/" if prefix else ""
    else:
        if is_s3:
            raise ConfigError(f"tier {spec}: backend {backend} needs a directory, not {target!r}")
        path = os.path.abspath(target)

    layout = spec.choice("layout", LAYOUTS, "dynamic")
    slot_size = spec.size("slot_size", DEFAULT_SLOT_SIZE)
    slots = spec.integer("slots", 0, minimum=0, maximum=MAX_SIZE // ALIGN)  # within the largest size
    capacity = spec.size("capacity", 0)
    direct = spec.flag("direct", False)
    if direct and backend == "OBJ":
        raise ConfigError(f"tier {spec}: direct=true applies to file backends only")
    if layout == "static":
        if slot_size < ALIGN or slot_size % ALIGN:
            raise ConfigError(f"tier {spec}: slot_size must be a multiple of {ALIGN} bytes")
        if slots and capacity and capacity != slots * slot_size:
            raise ConfigError(f"tier {spec}: give capacity or slots (capacity = slots x slot_size), not both")
        slots = slots or capacity // slot_size
        if slots < 1:
            raise ConfigError(f"tier {spec}: layout=static needs slots=N or a capacity of at least one slot")
        capacity = slots * slot_size
        max_object = slot_size
        spec.size("max_object", 0)  # accepted and ignored: the slot bounds every object
    else:
        if not capacity:
            raise ConfigError(f"tier {spec}: layout=dynamic needs capacity=SIZE (for example 500GiB)")
        max_object = spec.size("max_object", DEFAULT_MAX_OBJECT)
        if max_object < 1:
            raise ConfigError(f"tier {spec}: max_object must be at least 1 byte")

    shared = spec.flag("shared", False)
    if shared and layout == "static":
        raise ConfigError(f"tier {spec}: shared=true needs layout=dynamic (slots cannot be shared)")
    refresh = spec.seconds("refresh", DEFAULT_REFRESH_S if shared else 0.0)
    probe = spec.flag("probe", shared)
    timeout = spec.seconds("timeout", DEFAULT_TIMEOUT_S, minimum=0.001)
    lanes = spec.integer("lanes", 4 if backend == "OBJ" else 1, minimum=1)
    fsync = spec.flag("fsync", False)
    if fsync and backend == "OBJ":
        raise ConfigError(f"tier {spec}: fsync applies to file backends only")

    endpoint = spec.string("endpoint", os.environ.get("AWS_ENDPOINT_URL", ""))
    region = spec.string("region", os.environ.get("AWS_DEFAULT_REGION", "us-east-1"))
    access_key = spec.string("access_key", "")
    secret_key = spec.string("secret_key", "")
    virtual_host = spec.flag("virtual_host", False)
    if backend != "OBJ" and any(n in dict(spec.options) for n in ("endpoint", "access_key", "secret_key")):
        raise ConfigError(f"tier {spec}: endpoint and credentials apply to backend=OBJ only")

    params = tuple(
        (name[len(PARAM_PREFIX) :], spec.string(name, value))
        for name, value in spec.options
        if name.startswith(PARAM_PREFIX) and len(name) > len(PARAM_PREFIX)
    )
    return NixlOptions(
        backend=backend,
        layout=layout,
        path=path,
        bucket=bucket,
        prefix=prefix,
        capacity=capacity,
        slot_size=slot_size,
        slots=slots if layout == "static" else 0,
        max_object=max_object,
        direct=direct,
        fsync=fsync,
        lanes=lanes,
        timeout=timeout,
        shared=shared,
        refresh=refresh,
        probe=probe,
        endpoint=endpoint,
        region=region,
        access_key=access_key,
        secret_key=secret_key,
        virtual_host=virtual_host,
        params=params,
        name=spec.string("name", "nixl"),
    )
