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
from pathlib import Path

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
