"""Compiled builds (setup.py, docs/building.md): what a build compiled runs compiled,
LMSERVER_PURE=1 runs the sources, and a stale build never runs.

CI runs the suite on one compiled install with ``LMSERVER_EXPECT_COMPILED=1`` (a build that
fell back to pure Python fails here), then the tests of the compiled modules again with
``LMSERVER_PURE=1`` (.ci/run).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmserver
from lmproto import _native
from lmserver import _native as server_native

MYPYC = _native.MYPYC + server_native.MYPYC
C_TWINS = _native.C_TWINS + server_native.C_TWINS


def _built(name: str) -> list[Path]:
    """Compiled files of module ``name`` beside its source (what a build left there)."""
    package = importlib.import_module(name.rpartition(".")[0])
    leaf = name.rpartition(".")[2]
    return [
        Path(folder) / (leaf + suffix)
        for folder in package.__path__
        for suffix in importlib.machinery.EXTENSION_SUFFIXES
        if (Path(folder) / (leaf + suffix)).exists()
    ]


def _runs_from(name: str) -> str:
    """The file of the code module ``name`` runs: its own, or for a selector its chosen twin's."""
    module = sys.modules[name]
    if name in C_TWINS:
        module = sys.modules[f"{name}_{'c' if module.COMPILED else 'py'}"]
    return module.__file__ or ""


def test_each_package_lists_its_own_compiled_modules() -> None:
    assert all(name.startswith("lmproto.") for name in _native.MYPYC + _native.C_TWINS)
    assert all(name.startswith("lmserver.") for name in server_native.MYPYC + server_native.C_TWINS)


def test_what_the_build_compiled_runs_compiled() -> None:
    status = lmserver.compiled()
    assert set(status) == set(MYPYC + C_TWINS)
    if _native.pure_requested():
        assert not any(status.values()), status
        return
    expect_all = os.environ.get("LMSERVER_EXPECT_COMPILED", "") not in ("", "0")
    for name, native in status.items():
        built = _built(name + "_c" if name in C_TWINS else name)
        if expect_all or built:
            assert native, f"{name} runs from {_runs_from(name)}, not compiled"
            assert Path(_runs_from(name)).suffix in {".so", ".pyd"}
        else:
            assert not native and _runs_from(name).endswith(".py")
        if name in MYPYC:
            assert native == isinstance(sys.modules[name].__loader__, importlib.machinery.ExtensionFileLoader)
    # All or none: one compiled module calls another's compiled code directly, so a mix (a
    # stale build beside edited sources) would not run what the sources say.
    assert len(set(status.values())) == 1, status


def test_pure_env_imports_the_sources() -> None:
    code = (
        "import json, sys, lmserver, lmserver.connection.protocol\n"
        "names = [m for m in sys.modules if m.startswith(('lmproto.', 'lmserver.'))]\n"
        "print(json.dumps([lmserver.compiled(), [sys.modules[m].__file__ for m in names]]))"
    )
    env = {**os.environ, "LMSERVER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    status, files = json.loads(out.stdout)
    assert status == dict.fromkeys(MYPYC + C_TWINS, False)
    assert all(f.endswith(".py") for f in files), files


def _fake_build(
    root: Path, package: str, *, source_age: float, build_age: float, source: str = "mod.py"
) -> None:
    """A package with module ``mod``: its source and a compiled file, each ``age`` seconds old."""
    folder = root / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    now = time.time()
    for name, age in ((source, source_age), ("mod" + importlib.machinery.EXTENSION_SUFFIXES[0], build_age)):
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (now - age, now - age))


def test_a_source_edited_after_its_build_counts_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_build(tmp_path, "edited_pkg", source_age=10, build_age=60)
    _fake_build(tmp_path, "edited_c_pkg", source_age=10, build_age=60, source="mod.c")
    _fake_build(tmp_path, "fresh_pkg", source_age=60, build_age=10)
    _fake_build(tmp_path, "fresh_c_pkg", source_age=60, build_age=10, source="mod.c")
    # A wheel install writes source and build moments apart, in any order: not stale.
    _fake_build(tmp_path, "wheel_pkg", source_age=10, build_age=10 + _native.STALE_AFTER / 2)
    names = ["edited_pkg.mod", "edited_c_pkg.mod", "fresh_pkg.mod", "fresh_c_pkg.mod", "wheel_pkg.mod"]
    assert _native.stale_builds([*names, "absent_pkg.mod"]) == ["edited_pkg.mod", "edited_c_pkg.mod"]
    # A C twin's build is also stale after an edit to a C header it may include.
    header = tmp_path / "shared.h"
    header.write_bytes(b"")
    monkeypatch.setattr(_native, "C_HEADERS", (str(header),))
    assert _native.stale_builds(names) == ["edited_pkg.mod", "edited_c_pkg.mod", "fresh_c_pkg.mod"]


@pytest.fixture
def no_source_finders(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.PURE_ENV, raising=False)
    finders = [f for f in sys.meta_path if not isinstance(f, _native._SourceFirst)]
    monkeypatch.setattr(sys, "meta_path", finders)


def test_a_stale_build_runs_its_modules_from_source(
    monkeypatch: pytest.MonkeyPatch, no_source_finders: None
) -> None:
    modules = ("lmserver.connection", "lmserver.storage.memory")
    monkeypatch.setattr(_native, "stale_builds", lambda names: ["lmserver.storage.memory"])
    with pytest.warns(RuntimeWarning, match="lmserver.storage.memory changed after it was compiled"):
        assert _native.run_from_source(modules)
    finder = sys.meta_path[0]
    assert isinstance(finder, _native._SourceFirst) and finder.modules == set(modules)
    monkeypatch.setattr(_native, "stale_builds", lambda names: [])
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])
    assert not _native.run_from_source(modules)  # nothing stale, nothing asked: compiled modules load
    # What runs from source because another package's sources run (``also``) says nothing.
    assert _native.run_from_source(modules, also=True)
    assert isinstance(sys.meta_path[0], _native._SourceFirst)


def test_a_stale_c_twin_gives_way_to_its_python_twin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.PURE_ENV, raising=False)
    monkeypatch.setattr(_native, "stale_builds", lambda names: list(names))
    built = importlib.util.find_spec("lmserver._framed_c") is not None
    if built:
        with pytest.warns(
            RuntimeWarning, match="lmserver._framed_c changed .* its Python twin lmserver._framed_py"
        ):
            assert not _native.use_c_twin("lmserver._framed")
    else:
        assert not _native.use_c_twin("lmserver._framed")  # a pure build: nothing to warn about
    monkeypatch.setattr(_native, "stale_builds", lambda names: [])
    assert _native.use_c_twin("lmserver._framed") == built
    monkeypatch.setenv(_native.PURE_ENV, "1")
    assert not _native.use_c_twin("lmserver._framed")
