"""mypyc builds (setup.py): what a build compiled runs compiled, and LMSERVER_PURE=1 runs the sources.

CI runs the suite twice on one compiled install: with ``LMSERVER_EXPECT_COMPILED=1`` (a build
that fell back to pure Python fails here) and with ``LMSERVER_PURE=1``.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import lmserver
from lmproto import _native


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


def test_what_the_build_compiled_runs_compiled() -> None:
    status = lmserver.compiled()
    assert set(status) == set(_native.COMPILED_MODULES)
    if _native.pure_requested():
        assert not any(status.values()), status
        return
    expect_all = os.environ.get("LMSERVER_EXPECT_COMPILED", "") not in ("", "0")
    for name, native in status.items():
        module = sys.modules[name]
        if expect_all or _built(name):
            assert native, f"{name} runs from {module.__file__}, not compiled"
            assert Path(module.__file__ or "").suffix in {".so", ".pyd"}
            assert isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader)
        else:
            assert not native and (module.__file__ or "").endswith(".py")
    # All or none: one compiled module calls another's compiled code directly, so a mix (a
    # stale build beside edited sources) would not run what the sources say.
    assert len(set(status.values())) == 1, status


def test_pure_env_imports_the_sources() -> None:
    code = (
        "import json, sys, lmserver, lmserver.connection\n"
        "print(json.dumps([lmserver.compiled(), [sys.modules[m].__file__ for m in lmserver.compiled()]]))"
    )
    env = {**os.environ, "LMSERVER_PURE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    status, files = json.loads(out.stdout)
    assert status == dict.fromkeys(_native.COMPILED_MODULES, False)
    assert all(f.endswith(".py") for f in files), files


def _fake_build(root: Path, package: str, *, source_age: float, build_age: float) -> None:
    """A package with module ``mod``: its source and a compiled file, each ``age`` seconds old."""
    folder = root / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    now = time.time()
    for name, age in (("mod.py", source_age), ("mod" + importlib.machinery.EXTENSION_SUFFIXES[0], build_age)):
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (now - age, now - age))


def test_a_source_edited_after_its_build_counts_as_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    _fake_build(tmp_path, "edited_pkg", source_age=10, build_age=60)
    _fake_build(tmp_path, "fresh_pkg", source_age=60, build_age=10)
    # A wheel install writes source and build moments apart, in any order: not stale.
    _fake_build(tmp_path, "wheel_pkg", source_age=10, build_age=10 + _native.STALE_AFTER / 2)
    names = ["edited_pkg.mod", "fresh_pkg.mod", "wheel_pkg.mod", "absent_pkg.mod"]
    assert _native.stale_builds(names) == ["edited_pkg.mod"]


def test_a_stale_build_runs_every_module_from_source(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(_native.PURE_ENV, raising=False)
    finders = [f for f in sys.meta_path if not isinstance(f, _native._SourceFirst)]
    monkeypatch.setattr(sys, "meta_path", finders)
    monkeypatch.setattr(_native, "stale_builds", lambda: ["lmserver.connection"])
    with pytest.warns(RuntimeWarning, match="lmserver.connection changed after it was compiled"):
        assert _native.install_pure_finder()
    assert isinstance(sys.meta_path[0], _native._SourceFirst)
    monkeypatch.setattr(_native, "stale_builds", lambda: [])
    monkeypatch.setattr(sys, "meta_path", sys.meta_path[1:])
    assert not _native.install_pure_finder()  # nothing stale, nothing asked: compiled modules load
