"""The lmproto package surface: exports, and standard library only."""

from __future__ import annotations

import json
import subprocess
import sys

import lmproto


def test_all_members_exist() -> None:
    assert len(lmproto.__all__) == len(set(lmproto.__all__))
    for name in lmproto.__all__:
        assert hasattr(lmproto, name), name


def test_public_names_are_exported() -> None:
    public = {name for name in vars(lmproto) if not name.startswith("_")}
    assert public == set(lmproto.__all__)


def test_imports_only_the_standard_library() -> None:
    code = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "import lmproto\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = json.loads(out)
    assert "lmproto" in loaded
    outside = [
        name
        for name in loaded
        if name.partition(".")[0] != "lmproto" and name.partition(".")[0] not in sys.stdlib_module_names
    ]
    assert outside == []
