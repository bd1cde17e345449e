"""Compiled modules: which ones lmproto has, and when they run. docs/building.md tells the scheme.

Strategy: two kinds, each listed here for lmproto (and in lmserver/_native.py for lmserver;
setup.py reads both lists from the source):

* ``MYPYC``: modules mypyc compiles from their own ``.py`` into an extension module of the same
  name beside it, which Python imports first. ``run_from_source`` puts a finder in front that
  imports the ``.py`` instead when ``LMSERVER_PURE=1`` asks, or when a build is older than its
  source: running code that no file shows is the worst kind of surprise, so a stale build
  never runs, and a warning says how to rebuild.
* ``C_TWINS``: selectors. ``<name>.py`` imports its hand-written C twin ``<name>_c`` (built from
  ``<name>_c.c``) if ``use_c_twin`` says so, else its Python twin ``<name>_py``, the reference
  and the pure build (the msgpack and yarl habit).

``LMSERVER_PURE=1`` is the one switch for both. Standard library only, like the rest of lmproto.
"""

from __future__ import annotations

import glob
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MYPYC = ("lmproto._decode",)
"""lmproto's modules a build compiles with mypyc: the header decoders."""

C_TWINS = ("lmproto._lookup",)
"""lmproto's selectors of a C twin: the key scan of bodiless headers."""

PURE_ENV = "LMSERVER_PURE"
"""Set to 1 to run the Python sources even where compiled modules are present."""

STALE_AFTER = 2.0
"""Seconds a source may be newer than its compiled module before the build counts as stale.
Installing a wheel writes both within moments, in no set order; an edit comes later."""

C_HEADERS = tuple(sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "*.h"))))
"""The C headers every C twin may include (the key scan, buffers read in place): an edit to
one makes every C twin stale, as it makes setup.py rebuild them all. None in a wheel."""


def pure_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


class _SourceFirst:
    """A meta path finder for some mypyc-compiled modules that finds only their ``.py`` files."""

    def __init__(self, modules: Sequence[str]) -> None:
        self.modules = frozenset(modules)

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in self.modules or path is None:
            return None
        leaf = name.rpartition(".")[2] + ".py"
        for entry in path:
            source = os.path.join(entry, leaf)
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(name, source)
        return None  # no source here: let the other finders try


def _package_folders(package: str) -> list[str]:
    """Where ``package``'s modules live, found without importing it (it may be mid-import)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def stale_builds(modules: Sequence[str]) -> list[str]:
    """The modules whose compiled file is older than one of their sources by more than
    STALE_AFTER: the ``.py`` of a mypyc module; the ``.c`` of a C twin, and ``C_HEADERS``."""
    stale = []
    for name in modules:
        package, _, leaf = name.rpartition(".")
        for folder in _package_folders(package):
            sources = [os.path.join(folder, leaf + ext) for ext in (".py", ".c")]
            sources = [s for s in sources if os.path.isfile(s)]
            if any(s.endswith(".c") for s in sources):
                sources += C_HEADERS
            suffixes = importlib.machinery.EXTENSION_SUFFIXES
            builds = [os.path.join(folder, leaf + suffix) for suffix in suffixes]
            built = [os.path.getmtime(b) for b in builds if os.path.isfile(b)]
            if built and sources and max(map(os.path.getmtime, sources)) > max(built) + STALE_AFTER:
                stale.append(name)
    return stale


def _warn_stale(stale: Sequence[str], instead: str) -> None:
    warnings.warn(
        f"lmserver: {', '.join(stale)} changed after it was compiled; running {instead}. "
        "Rebuild (pip install -e ., or python setup.py build_ext --inplace) to run compiled, "
        f"or set {PURE_ENV}=1 to say you mean it.",
        RuntimeWarning,
        stacklevel=3,
    )


def run_from_source(modules: Sequence[str], *, also: bool = False) -> bool:
    """Import the ``.py`` of the mypyc-compiled ``modules`` from now on if ``LMSERVER_PURE``
    asks for it, if ``also``, or if one of them is stale (with a warning). Returns whether the
    sources run. A package calls it before it imports any of them. All of them or none,
    because compiled modules call each other's compiled code directly."""
    if not (pure_requested() or also):
        stale = stale_builds(modules)
        if not stale:
            return False
        _warn_stale(stale, "these modules, and the compiled modules that call them, from source")
    sys.meta_path.insert(0, _SourceFirst(modules))
    return True


def use_c_twin(selector: str) -> bool:
    """Whether the selector module ``selector`` imports its C twin ``<selector>_c``: the build
    made it, it is not older than its C source (a warning if it is), and ``LMSERVER_PURE`` is
    unset. A C twin calls no compiled Python, so each selector decides alone."""
    if pure_requested():
        return False
    twin = selector + "_c"
    if importlib.util.find_spec(twin) is None:
        return False  # a pure build
    if stale_builds([twin]):
        _warn_stale([twin], f"its Python twin {selector}_py")
        return False
    return True


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension module rather than a source file."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


def status(mypyc: Sequence[str], c_twins: Sequence[str]) -> dict[str, bool]:
    """Whether each of these modules runs compiled: a mypyc module loaded from its extension
    module, a selector that imported its C twin."""
    found = {name: is_compiled(importlib.import_module(name)) for name in mypyc}
    found.update({name: bool(importlib.import_module(name).COMPILED) for name in c_twins})
    return found


def compiled() -> dict[str, bool]:
    """For each of lmproto's compiled modules: whether it runs compiled here."""
    return status(MYPYC, C_TWINS)


SOURCES = run_from_source(MYPYC)
"""Whether lmproto's mypyc modules run from source (lmproto/__init__ imports this module first)."""
