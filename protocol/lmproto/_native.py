"""Which modules a build compiles (mypyc, or a C twin), whether they run compiled, and how to ignore them.

Strategy: ``setup.py`` compiles the modules in ``COMPILED_MODULES`` (it reads this tuple
from this file's source, so there is one list; mypyc compiles all but ``HAND_WRITTEN_C``,
which have a C twin) into extension modules that sit beside their
``.py`` sources, and Python imports an extension module before a source file of the same
name. ``LMSERVER_PURE=1`` in the environment installs a finder that imports the sources
instead, so one installation can run, and be tested, both ways. It is read once, when
``lmproto`` is first imported (``lmserver`` imports ``lmproto`` first thing).

A source edited after its build (an editable install, then a change) would otherwise be
shadowed by the old compiled code: running code that no file shows is the worst kind of
surprise. So a compiled module older than its source makes every compiled module load from
source, with a warning that says how to rebuild. All of them, because compiled modules call
each other's compiled code directly.

Standard library only, like the rest of lmproto; lmserver's names are listed here too so that
the finder is in place before either package imports any of them.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

COMPILED_MODULES = (
    "lmproto._decode",
    "lmproto._lookup",
    "lmserver._framed",
    "lmserver._shard",
    "lmserver.connection",
    "lmserver.storage.memory",
    "lmserver.plain",
    "lmserver.storage.store",
)
"""The modules a build compiles: the hot path (header decoders, the parse/dispatch loop, and
the memory tier and store lookups a request makes)."""

HAND_WRITTEN_C = ("lmproto._lookup", "lmserver._framed", "lmserver._shard")
"""The modules of ``COMPILED_MODULES`` compiled from a C twin (``<module>.c`` beside its
``.py``) rather than by mypyc. The ``.py`` stays the reference and the pure build."""

PURE_ENV = "LMSERVER_PURE"
"""Set to 1 to import the Python sources even where compiled modules are present."""

STALE_AFTER = 2.0
"""Seconds a source may be newer than its compiled module before the build counts as stale.
Installing a wheel writes both within moments, in no set order; an edit comes later."""


def pure_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


class _SourceFirst:
    """A meta path finder for ``COMPILED_MODULES`` that finds only their ``.py`` files."""

    def find_spec(
        self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name not in COMPILED_MODULES or path is None:
            return None
        leaf = name.rpartition(".")[2] + ".py"
        for entry in path:
            source = os.path.join(entry, leaf)
            if os.path.isfile(source):
                return importlib.util.spec_from_file_location(name, source)
        return None  # no source here: let the other finders try


def _package_folders(package: str) -> list[str]:
    """Where ``package``'s modules live, found without importing it (lmserver may be mid-import)."""
    if package == __package__:
        return [os.path.dirname(os.path.abspath(__file__))]
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return []
    return list(spec.submodule_search_locations or []) if spec is not None else []


def stale_builds(modules: Sequence[str] = COMPILED_MODULES) -> list[str]:
    """The modules whose compiled file is older than one of their sources (the ``.py``, and the
    ``.c`` of a hand-written module) by more than STALE_AFTER."""
    stale = []
    for name in modules:
        package, _, leaf = name.rpartition(".")
        for folder in _package_folders(package):
            sources = [os.path.join(folder, leaf + ext) for ext in (".py", ".c")]
            edited = [os.path.getmtime(s) for s in sources if os.path.isfile(s)]
            suffixes = importlib.machinery.EXTENSION_SUFFIXES
            builds = [os.path.join(folder, leaf + suffix) for suffix in suffixes]
            built = [os.path.getmtime(b) for b in builds if os.path.isfile(b)]
            if built and edited and max(edited) > max(built) + STALE_AFTER:
                stale.append(name)
    return stale


def install_pure_finder() -> bool:
    """Import the sources of ``COMPILED_MODULES`` from now on if ``LMSERVER_PURE`` asks for it,
    or if a compiled module is older than its source (with a warning).

    Returns whether the finder is in place. Modules already imported stay as they are."""
    if any(isinstance(finder, _SourceFirst) for finder in sys.meta_path):
        return True
    if not pure_requested():
        stale = stale_builds()
        if not stale:
            return False
        warnings.warn(
            f"lmserver: {', '.join(stale)} changed after it was compiled; running every module "
            "from source. Rebuild (pip install -e .) to run compiled, or set LMSERVER_PURE=1 "
            "to say you mean it.",
            RuntimeWarning,
            stacklevel=2,
        )
    sys.meta_path.insert(0, _SourceFirst())
    return True


def is_compiled(module: ModuleType) -> bool:
    """Whether ``module`` was loaded from an extension module (a mypyc build) rather than source."""
    return isinstance(getattr(module, "__loader__", None), importlib.machinery.ExtensionFileLoader)


def compiled() -> dict[str, bool]:
    """For each module in ``COMPILED_MODULES`` that can be imported: whether it runs compiled."""
    status: dict[str, bool] = {}
    for name in COMPILED_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name.partition(".")[0]:
                raise  # a broken build (a compiled module without its shared library, ...)
            continue  # lmproto installed without lmserver
        status[name] = is_compiled(module)
    return status


install_pure_finder()  # on first import: lmproto/__init__ imports this module before any other
