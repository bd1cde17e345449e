"""The README's test command is what CI runs: the last line of .ci/run, after its ``cd``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_test_command_is_what_ci_runs() -> None:
    script = (ROOT / ".ci" / "run").read_text().strip().splitlines()
    assert script[-2] == 'cd "$(dirname "$0")/.."'
    quick_start = (ROOT / "README.md").read_text().partition("## Quick start")[2].partition("\n## ")[0]
    commands = re.findall(r"```sh\n(.*?)\n```", quick_start, re.DOTALL)
    assert script[-1] in commands, commands
