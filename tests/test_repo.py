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


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file (lower case, punctuation dropped, spaces to
    hyphens, a repeated heading numbered -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            in_code = not in_code
        m = None if in_code else re.match(r"#{1,6} (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_relative_markdown_links_resolve():
    """Every relative link in README.md, docs/*.md and lab/*.md points at a file that exists,
    and its #anchor, if any, at a heading of that file."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "lab").glob("**/*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
