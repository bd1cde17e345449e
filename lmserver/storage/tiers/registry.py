"""Tier kinds: ``--tier KIND:...`` names a class here, imported only when asked for.

Strategy (uvicorn's name -> import path maps): the server never imports a backend's library
unless the operator configured that backend, so ``pip install lmserver`` stays small and a
missing extra is one clear startup error naming the extra, never a traceback.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .base import ConfigError, Tier
from .spec import ChainOptions, TierSpec, chain_options

TierFactory = Callable[[TierSpec], Tier]

KINDS: dict[str, tuple[str, str | None]] = {
    # kind: ("module:Class", the pip extra that brings its library)
    "disk": ("lmserver.storage.tiers.disk:DiskTier", None),
    "nixl": ("lmserver.storage.tiers.nixl:NixlTier", "nixl"),
    "hf": ("lmserver.storage.tiers.hf:HFBucketTier", "hf"),
}
_extra_kinds: dict[str, TierFactory] = {}


def register(kind: str, factory: TierFactory) -> None:
    """Add a tier kind at run time (embedding applications and tests)."""
    _extra_kinds[kind] = factory


def unregister(kind: str) -> None:
    _extra_kinds.pop(kind, None)


def factory_for(kind: str) -> TierFactory:
    if kind in _extra_kinds:
        return _extra_kinds[kind]
    if kind not in KINDS:
        raise ConfigError(f"unknown tier kind {kind!r} (known: {', '.join(sorted({*KINDS, *_extra_kinds}))})")
    path, extra = KINDS[kind]
    module_name, _, class_name = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = f"; install it with: pip install 'lmserver[{extra}]'" if extra else ""
        raise ConfigError(f"tier kind {kind!r} needs a package that is not installed ({exc}){hint}") from None
    cls: type[Tier] = getattr(module, class_name)
    return cls.from_spec


def build(spec: TierSpec) -> tuple[Tier, ChainOptions]:
    """The tier and its chain options; ConfigError for anything wrong in the spec."""
    factory = factory_for(spec.kind)
    tier = factory(spec)
    options = chain_options(spec, tier.default_mode)
    spec.finish()
    return tier, options
