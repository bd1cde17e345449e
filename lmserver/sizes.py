"""Human byte sizes: ``8GiB``, ``512MB``, ``64k``, ``1048576``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

MAX_SIZE = 1 << 60
"""The largest size anything takes (1 EiB): far above any real device, and far below where
sizes stop fitting the 64-bit integers of the index, the OS and the wire."""


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (at most ``MAX_SIZE``); bare single letters (k, m, g, t) are binary
    like ``dd`` and ``ulimit``. A whole number of bytes may also be given as an int (a TOML
    integer); a float is refused, as ``1.5`` bytes or ``inf`` mean nothing."""
    if isinstance(text, bool) or not isinstance(text, int | str):
        raise ValueError(f"not a size: {text!r} (a whole number of bytes, or a string such as '8GiB')")
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE.match(text)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"not a size: {text!r} (examples: 8GiB, 512MB, 64k, 1048576)")
        number, unit = match.group(1), _UNITS[match.group(2).lower()]
        # Exact for whole numbers (no float rounding of 2**60-ish values); 1.5GiB as float.
        size = int(number) * unit if number.isdigit() else int(float(number) * unit)
    if size < 0:
        raise ValueError(f"size must not be negative: {text}")
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is larger than {format_size(MAX_SIZE)}")
    return size


_FORMAT_UNITS = tuple(
    (unit, 1024 ** (6 - i)) for i, unit in enumerate(("EiB", "PiB", "TiB", "GiB", "MiB", "KiB"))
)


def format_size(n: int) -> str:
    for unit, scale in _FORMAT_UNITS:
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return f"{n}B"
