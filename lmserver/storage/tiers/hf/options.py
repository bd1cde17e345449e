"""The HF Buckets tier's configuration: ``--tier hf://buckets/...?OPTION=VALUE&...`` (no Hub imports)."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, NamedTuple

from ..errors import ConfigError
from .naming import Handle, parse_handle

if TYPE_CHECKING:
    from ..spec import TierSpec

ReadMode = Literal["auto", "stream", "file"]


@dataclass(frozen=True)
class Options:
    capacity: int = 0
    trigger: float = 0.8
    ratio: float = 0.2
    refresh_s: float = 30.0
    workers: int = 4
    batch_ops: int = 64
    batch_bytes: int = 256 << 20
    window_s: float = 0.05
    max_pending: int = 1 << 30
    create: bool = False
    private: bool = True
    cache_dir: str | None = None
    read_mode: ReadMode = "auto"
    timeout_s: float = 60.0
    learn_keys: bool = True
    read_piece: int = 1 << 20
    probe: bool = True


def _fraction(spec: TierSpec, name: str, default: float) -> float:
    value = spec.string(name, "")
    if not value:
        return default
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"tier {spec}: option {name}={value!r}: expected a number in (0, 1]") from None
    if not 0 < number <= 1:
        raise ConfigError(f"tier {spec}: option {name}={value!r}: expected a number in (0, 1]")
    return number


class Config(NamedTuple):
    handle: Handle
    token: str | None
    endpoint: str | None
    options: Options
    name: str


def config_from_spec(spec: TierSpec) -> Config:
    """Read every option of the spec (docs/tiers.md lists them); ConfigError for bad ones.
    The token comes from the variable named by ``token_env`` if set, else ``token=``."""
    handle = parse_handle("hf:" + spec.target)
    for module in ("huggingface_hub", "hf_xet"):
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"tier {spec}: needs {module}; install it with: pip install 'lmserver[hf]'")
    token_env = spec.string("token_env", "HF_TOKEN")
    token_option = spec.string("token", "")  # read either way: it is a known option
    token = os.environ.get(token_env) or token_option or None
    endpoint = spec.string("endpoint", "") or os.environ.get("HF_ENDPOINT") or None
    read_mode: ReadMode = spec.choice("read", ("auto", "stream", "file"), "auto")
    options = Options(
        capacity=spec.size("capacity", 0),
        trigger=_fraction(spec, "trigger", 0.8),
        ratio=_fraction(spec, "ratio", 0.2),
        refresh_s=spec.seconds("refresh", 30.0),
        workers=spec.integer("workers", 4, minimum=1),
        batch_ops=spec.integer("batch", 64, minimum=1),
        batch_bytes=spec.size("batch_bytes", 256 << 20),
        window_s=spec.seconds("window", 0.05),
        max_pending=spec.size("max_pending", 1 << 30),
        create=spec.flag("create", False),
        private=spec.flag("private", True),
        cache_dir=spec.string("cache_dir", "") or None,
        read_mode=read_mode,
        timeout_s=spec.seconds("timeout", 60.0, minimum=1.0),
        learn_keys=spec.flag("learn_keys", True),
        read_piece=max(64 << 10, spec.size("read_piece", 1 << 20)),
        probe=spec.flag("probe", True),
    )
    name = spec.string("name", "hf")
    return Config(handle, token, endpoint, options, name)
