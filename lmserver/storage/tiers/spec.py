"""``--tier`` specifications: one string per tier behind memory, parsed once at startup.

Syntax: ``KIND:TARGET[?OPTION=VALUE&...]``, for example::

    disk:/mnt/slow-ssd?capacity=2TiB&mode=demote&fsync=batch
    nixl:/mnt/nvme/lms?backend=POSIX&capacity=500GiB
    hf://buckets/my-org/kv-cache/prefix?capacity=10TiB

The kind picks the tier class (``registry.py``); the target is kind-specific (a directory,
a bucket handle: ``hf://buckets/...`` is kind ``hf`` with target ``//buckets/...``).
Two options belong to the chain and are understood for every kind:

* ``mode``: ``write-behind`` (every PUT is copied here, best effort) or ``demote`` (only
  what the tier in front evicts lands here). Defaults per kind (``Tier`` classes say).
* ``queue``: bytes of objects that may wait to be written to this tier (write-behind and
  demotion together).
* ``full``: what happens when the tier's queue (or the memory share for objects waiting for
  tiers, ``--dirty-limit``) is full: ``wait`` (a PUT's connection reads no more bodies until
  the tier catches up, up to ``--memory-wait``; memory never drops an object this tier does
  not hold yet) or ``skip`` (count it and go on). The default follows the mode: ``wait``
  with ``write-behind`` (the operator asked for every object there), ``skip`` with
  ``demote`` (a cold tier takes what it can of what memory lets go).

Every other option is the tier's own; a tier reads them with the typed getters below and
``finish()`` rejects any it did not read, so a typo is a startup error, not a silent default.
"""

from __future__ import annotations

import re
import urllib.parse
from dataclasses import dataclass, field
from typing import Literal, TypeVar, get_args

from ...sizes import MAX_SIZE, format_size, parse_size
from .errors import ConfigError

Mode = Literal["write-behind", "demote"]
MODES: tuple[Mode, ...] = get_args(Mode)
Full = Literal["wait", "skip"]
FULL_POLICIES: tuple[Full, ...] = get_args(Full)
DEFAULT_QUEUE_BYTES = 256 * 1024**2
MAX_COUNT = 1024
"""Largest integer option unless a tier says otherwise: counts of threads (``workers``),
lanes and batch entries, where a typo of a few digits would start thousands of threads."""
_S = TypeVar("_S", bound=str)
_SECRET = re.compile(r"(?<=[?&])([^=&]*(?:token|secret|password)[^=&]*)=[^&]*", re.IGNORECASE)
"""Options whose values are masked in logs and errors: ``token``, ``secret_key``, ..."""


@dataclass(frozen=True)
class TierSpec:
    kind: str
    target: str
    options: tuple[tuple[str, str], ...] = ()
    text: str = ""
    _read: set[str] = field(default_factory=set, compare=False, repr=False)

    @classmethod
    def parse(cls, text: str) -> TierSpec:
        kind, sep, rest = text.partition(":")
        kind = kind.strip().lower()
        if not sep or not kind.isidentifier():
            raise ConfigError(f"tier {text!r}: expected KIND:TARGET[?OPTION=VALUE&...]")
        target, _, query = rest.partition("?")
        try:
            pairs = urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
        except ValueError:
            raise ConfigError(f"tier {text!r}: options must look like name=value&name=value") from None
        names = [name for name, _ in pairs]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ConfigError(f"tier {text!r}: option given twice: {', '.join(duplicated)}")
        return cls(kind, target, tuple(pairs), text)

    def __str__(self) -> str:
        # Secrets given as options (an HF token) must never reach logs or error messages.
        return _SECRET.sub(r"\1=***", self.text) or f"{self.kind}:{self.target}"

    def __repr__(self) -> str:
        return f"TierSpec({str(self)!r})"

    # -- typed option getters (each marks its option as understood) ---------------------

    def _raw(self, name: str) -> str | None:
        self._read.add(name)
        return dict(self.options).get(name)

    def _fail(self, name: str, value: str, expected: str) -> ConfigError:
        return ConfigError(f"tier {self}: option {name}={value!r}: expected {expected}")

    def string(self, name: str, default: str) -> str:
        value = self._raw(name)
        return default if value is None else value

    def size(self, name: str, default: int, *, minimum: int = 0) -> int:
        value = self._raw(name)
        if value is None:
            return default
        try:
            size = parse_size(value)  # at most sizes.MAX_SIZE (1 EiB)
        except ValueError:
            raise self._fail(name, value, f"a size such as 64GiB, at most {format_size(MAX_SIZE)}") from None
        if size < minimum:
            raise self._fail(name, value, f"a size of at least {format_size(minimum)}")
        return size

    def integer(self, name: str, default: int, *, minimum: int = 0, maximum: int = MAX_COUNT) -> int:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = int(value)
        except ValueError:
            raise self._fail(name, value, "an integer") from None
        if not minimum <= number <= maximum:
            raise self._fail(name, value, f"an integer from {minimum} to {maximum}")
        return number

    def seconds(self, name: str, default: float, *, minimum: float = 0.0) -> float:
        value = self._raw(name)
        if value is None:
            return default
        try:
            number = float(value)
        except ValueError:
            raise self._fail(name, value, "a number of seconds") from None
        if not number >= minimum:  # also rejects NaN
            raise self._fail(name, value, f"a number of seconds >= {minimum}")
        return number

    def flag(self, name: str, default: bool) -> bool:
        value = self._raw(name)
        if value is None:
            return default
        if value.lower() in ("1", "true", "yes", "on"):
            return True
        if value.lower() in ("0", "false", "no", "off"):
            return False
        raise self._fail(name, value, "true or false")

    def choice(self, name: str, choices: tuple[_S, ...], default: _S) -> _S:
        value = self._raw(name)
        if value is None:
            return default
        for candidate in choices:
            if value.lower() == candidate.lower():
                return candidate
        raise self._fail(name, value, "one of " + ", ".join(choices))

    def finish(self) -> None:
        """Reject options nobody read (typos), once the tier has read its own."""
        unknown = sorted(name for name, _ in self.options if name not in self._read)
        if unknown:
            raise ConfigError(f"tier {self}: unknown option(s): {', '.join(unknown)}")


@dataclass(frozen=True)
class ChainOptions:
    """What the Store needs to know about one tier, read from its spec."""

    mode: Mode
    queue_bytes: int
    full: Full = "skip"


def default_full(mode: Mode) -> Full:
    """``wait`` for a write-behind tier (it is to hold everything), ``skip`` for a demote one."""
    return "wait" if mode == "write-behind" else "skip"


def chain_options(spec: TierSpec, default_mode: Mode) -> ChainOptions:
    mode = spec.choice("mode", MODES, default_mode)
    return ChainOptions(
        mode=mode,
        queue_bytes=spec.size("queue", DEFAULT_QUEUE_BYTES),
        full=spec.choice("full", FULL_POLICIES, default_full(mode)),
    )
