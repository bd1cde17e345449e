"""The errors a tier raises, apart from ``base.py`` so that every module of the tiers (the
spec parser, the backends' option readers) can raise them without importing the interface.
``base`` re-exports them."""


class NoSpace(Exception):
    """A buffer or storage of the requested size cannot be had right now."""


class TierError(Exception):
    """A tier cannot serve a request (I/O error, unreachable backend, corrupt data)."""


class ConfigError(ValueError):
    """A tier's configuration is invalid or its backend is missing: a startup error."""
