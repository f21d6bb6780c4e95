"""The README's Quickstart is what CI runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quickstart_has_two_commands_and_ci_runs_the_test_one():
    cmds = quickstart_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "marscli generate" in cmds[0]
    assert "pytest" in cmds[1]
    assert cmds[1].endswith("python -m pytest -q --durations=20"), "CI prints the 20 slowest tests"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert cmds[1] in ci, "the test command in .ci/run must be the README's, verbatim"
