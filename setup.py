"""Build hook: compiles the server's hot path with mypyc. Everything else is in pyproject.toml.

* Default: each package's ``_native.py`` lists its compiled modules (docs/building.md), which
  become extension modules installed beside their sources (``pip install .``,
  ``pip install -e .``, ``python setup.py build_ext --inplace``): ``MYPYC``, compiled by mypyc
  under their own name; ``C_TWINS``, selectors whose C twin ``<name>_c`` is built from
  ``<name>_c.c``.
* ``LMSERVER_COMPILE=0``: pure Python.
* Every run first deletes compiled modules that earlier builds left in the source tree or in
  ``build/``: they would shadow the sources, or go into a wheel beside a newer build.
* A build that cannot compile (mypyc refuses the code, or there is no C compiler) warns and
  installs pure Python instead of failing.
* ``LMSERVER_PURE=1`` at run time ignores compiled modules that are present.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
COMPILE_ENV = "LMSERVER_COMPILE"


def _group(module: str) -> str:
    """The shared library holding ``module``'s compiled code: one per package, so that lmproto's
    compiled modules load nothing of lmserver (lmproto/_mypyc__mypyc.*.so, lmserver/...)."""
    return module.partition(".")[0] + "._mypyc"


def _warn(message: str) -> None:
    # setuptools hides stdout of a build; stderr shows (pip shows it with -v, or on failure).
    print(f"lmserver setup.py: WARNING: {message}", file=sys.stderr)


NATIVE_LISTS = (ROOT / "protocol" / "lmproto" / "_native.py", ROOT / "lmserver" / "_native.py")
"""Where each package lists its compiled modules."""


def _native_list(name: str) -> list[str]:
    """The tuples of module names called ``name`` in NATIVE_LISTS, read without importing them."""
    found: list[str] = []
    for path in NATIVE_LISTS:
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                found += ast.literal_eval(node.value)
                break
        else:
            raise RuntimeError(f"{name} not found in {path.relative_to(ROOT)}")
    return found


def _source(module: str, ext: str = ".py") -> str:
    """The source file of a module, relative to ROOT (lmproto lives under protocol/)."""
    path = module.replace(".", "/") + ext
    return f"protocol/{path}" if module.startswith("lmproto.") else path


def _remove_old_builds() -> None:
    """Delete compiled modules that earlier builds left in the source tree (an editable or
    ``build_ext --inplace`` build) or in ``build/lib.*`` (which a wheel is packed from): a stale
    one would shadow its source, or be packed beside a newer build. These packages have no
    other compiled modules; a compiled build makes its own again."""
    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    roots = [ROOT / "lmserver", ROOT / "protocol" / "lmproto"]
    for build_lib in (ROOT / "build").glob("lib.*"):
        roots += [build_lib / "lmserver", build_lib / "lmproto"]
    for root in roots:
        for found in root.rglob("*"):
            if found.name.endswith(suffixes) and found.is_file():
                _warn(f"removing {found.relative_to(ROOT)} (a compiled module from an earlier build)")
                found.unlink()


# mypy options for the compile, beside pyproject.toml's [tool.mypy] (which stays the strict
# check CI runs). In an isolated build (pip's default) only setuptools and mypy are installed,
# not the runtime dependencies (structlog, ...), so: missing imports are Any, modules that are
# not compiled are followed without reporting their errors, and the strict warnings that depend
# on whether a dependency is typed (unused ignores, returning Any, subclassing Any) are off.
MYPY_OPTIONS = [
    "--ignore-missing-imports",
    "--follow-imports=silent",
    "--no-warn-unused-ignores",
    "--no-warn-return-any",
    "--allow-subclassing-any",
]


def _mypyc_extensions(modules: list[str]) -> list[Any]:
    """The extension modules mypyc makes of ``modules``; [] (and a warning) if it cannot."""
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        _warn(f"mypyc is not installed ({exc}); building pure Python")
        return []
    cwd = os.getcwd()
    os.chdir(ROOT)  # mypy reads [tool.mypy] (mypy_path) from ./pyproject.toml
    try:
        groups: dict[str, list[str]] = {}
        for module in modules:
            groups.setdefault(_group(module), []).append(_source(module))
        return list(
            mypycify(
                MYPY_OPTIONS + [_source(m) for m in modules],
                opt_level="3",
                separate=[(files, name) for name, files in groups.items()],
            )
        )
    except (Exception, SystemExit) as exc:  # mypyc exits on type errors it cannot compile
        _warn(f"mypyc could not compile {modules} ({exc!r}); building pure Python")
        return []
    finally:
        os.chdir(cwd)


class BuildExt(build_ext):
    """Compiles the extensions (mypyc's and the C twins) all or none: a C compiler failure
    leaves a pure build."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # CompileError, LinkError, no compiler at all, ...
            _warn(f"compiling the mypyc extensions failed ({exc!r}); building pure Python")
            # A shim without its shared library would fail at import: drop every output.
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.unlink(path)
            self.extensions = []
            _remove_old_builds()


def _c_extensions(selectors: list[str]) -> list[Extension]:
    """The C twins of ``selectors`` (``C_TWINS``): plain extensions, -O3 like mypyc's. They may
    include lmproto's shared C headers (``_keyscan.h``, ``_inplace.h``)."""
    shared = sorted(str(h.relative_to(ROOT)) for h in (ROOT / "protocol" / "lmproto").glob("*.h"))
    return [
        Extension(
            m + "_c",
            [_source(m + "_c", ".c")],
            include_dirs=[os.path.dirname(shared[0])],
            depends=shared,  # a change to a header rebuilds every twin (and makes each stale)
            extra_compile_args=["-O3"],
        )
        for m in selectors
    ]


def _ext_modules() -> list[Any]:
    _remove_old_builds()
    if os.environ.get(COMPILE_ENV, "1") == "0":
        return []
    mypyc = _mypyc_extensions(_native_list("MYPYC"))
    # All or none, as BuildExt: a mypyc failure leaves no C twin either.
    return mypyc + _c_extensions(_native_list("C_TWINS")) if mypyc else []


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": BuildExt})
