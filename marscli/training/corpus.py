"""Training prompts for train-head from what every Python installation has on disk.

A head learns the target's own answers, so its prompts only need to look like the requests it
will draft for: code tasks and prose explanations. Without the hub they come from:

- code: the standard library's source (read with ``ast``, never imported), every public
  function or method with a docstring, turned into one of several instructions (implement it
  from its signature and docstring, explain it, write pytest tests for it, refactor it);
- prose: Python's own documentation topics (``pydoc_data.topics``: the language reference
  behind ``help('for')``), cut into passages to summarise or explain, and module docstrings
  to explain.

The instruction a function or passage gets is a function of its name only (a hash), so a
corpus is the same on every run of one Python version; records are ordered by the same hash,
which interleaves code and prose. Never built from ../shared/data/prompts: those are the
evaluation sets. Python's source and documentation are under the PSF licence.
"""

from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Standard-library folders left out: tests (their functions are test cases), GUI demos and
#: vendored or retired packages.
SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__",
                       "turtledemo", "ensurepip", "tkinter", "dist-packages", "config-3"})
MIN_DOC = 40  # characters of docstring a function needs
MAX_SOURCE_LINES = 60
PASSAGE = (400, 1400)  # characters of a documentation passage

CODE_TEMPLATES = (
    "Write a Python function `{name}{sig}` that does the following.\n\n{doc}",
    "Explain what the following Python function does, step by step.\n\n```python\n{src}\n```",
    "Write pytest unit tests for this function.\n\n```python\n{src}\n```",
    "Rewrite this Python function so that it is easier to read, with type hints and a "
    "docstring.\n\n```python\n{bare}\n```",
    "Implement `{name}{sig}` in Python. It should behave as described:\n\n{doc}\n\n"
    "Give only the code.",
)
PROSE_TEMPLATES = (
    "Summarize this passage from the Python documentation in a few sentences.\n\n{text}",
    "Explain the following to a programmer who is new to Python, with a short example.\n\n{text}",
    "What does this part of the Python language reference say? Answer in your own words.\n\n{text}",
)
MODULE_TEMPLATE = "What is the Python module `{name}` for? Explain it briefly, with an example.\n\n{doc}"


def _pick(key: str, n: int) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % n


def _order(key: str) -> str:
    return hashlib.sha256(("order:" + key).encode()).hexdigest()


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _source_files(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith(("config-", ".")))
        for f in sorted(files):
            if f.endswith(".py") and not f.startswith("_") or f == "__init__.py":
                path = Path(dirpath) / f
                rel = path.relative_to(root).with_suffix("")
                parts = [p for p in rel.parts if p != "__init__"]
                if parts:
                    yield ".".join(parts), path


def _signature(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    try:
        return "(" + ast.unparse(node.args) + ")"
    except Exception:  # noqa: BLE001 - an odd signature: leave it out
        return "(...)"


def _without_docstring(node: ast.FunctionDef | ast.AsyncFunctionDef) -> str:
    body = node.body[1:] if node.body and isinstance(node.body[0], ast.Expr) else node.body
    if not body:
        return ""
    clone = ast.FunctionDef(name=node.name, args=node.args, body=body, decorator_list=[],
                            returns=node.returns, type_comment=None, type_params=[])
    try:
        return ast.unparse(ast.fix_missing_locations(clone))
    except Exception:  # noqa: BLE001
        return ""


def code_records(root: Path | None = None) -> Iterator[dict[str, Any]]:
    """Instruction records from the standard library's documented public functions."""
    root = root or stdlib_dir()
    for module, path in _source_files(root):
        try:
            text = path.read_text(encoding="utf-8")
            tree = ast.parse(text)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        doc = ast.get_docstring(tree)
        if doc and len(doc) >= 200 and not module.startswith("_"):
            content = MODULE_TEMPLATE.format(name=module, doc=doc[:900].strip())
            yield {"id": f"module:{module}", "messages": [{"role": "user", "content": content}]}
        for owner, node in _functions(tree):
            name = node.name
            if name.startswith("_") and name != "__init__":
                continue
            fdoc = ast.get_docstring(node)
            if not fdoc or len(fdoc) < MIN_DOC:
                continue
            end = getattr(node, "end_lineno", None) or node.lineno
            if end - node.lineno + 1 > MAX_SOURCE_LINES:
                continue
            src = textwrap.dedent("\n".join(lines[node.lineno - 1:end]))
            qual = f"{module}.{owner + '.' if owner else ''}{name}"
            t = CODE_TEMPLATES[_pick(qual, len(CODE_TEMPLATES))]
            bare = _without_docstring(node) if "{bare}" in t else ""
            if "{bare}" in t and not bare:
                t = CODE_TEMPLATES[0]
            content = t.format(name=name, sig=_signature(node), doc=textwrap.dedent(fdoc).strip(),
                               src=src, bare=bare)
            yield {"id": f"code:{qual}", "messages": [{"role": "user", "content": content}]}


def _functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield "", node
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield node.name, sub


def passages(text: str) -> Iterator[str]:
    """Paragraph-aligned passages of PASSAGE[0]..PASSAGE[1] characters."""
    cur: list[str] = []
    size = 0
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        if size + len(para) > PASSAGE[1] and size >= PASSAGE[0]:
            yield "\n\n".join(cur)
            cur, size = [], 0
        if len(para) > PASSAGE[1]:
            para = para[:PASSAGE[1]].rsplit(" ", 1)[0]
        cur.append(para)
        size += len(para) + 2
    if size >= PASSAGE[0]:
        yield "\n\n".join(cur)


def prose_records() -> Iterator[dict[str, Any]]:
    """Instruction records from Python's documentation topics."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # a Python built without its documentation topics
        return
    for key in sorted(topics):
        for i, text in enumerate(passages(topics[key])):
            rid = f"doc:{key}:{i}"
            t = PROSE_TEMPLATES[_pick(rid, len(PROSE_TEMPLATES))]
            yield {"id": rid, "messages": [{"role": "user", "content": t.format(text=text)}]}


def build_corpus(limit: int | None = None, *, kinds: tuple[str, ...] = ("code", "prose"),
                 root: Path | None = None) -> list[dict[str, Any]]:
    """The corpus's records (dicts with id and messages), interleaved by a hash of their ids."""
    recs: list[dict[str, Any]] = []
    if "code" in kinds:
        recs += code_records(root)
    if "prose" in kinds:
        recs += prose_records()
    recs.sort(key=lambda r: _order(r["id"]))
    return recs[:limit] if limit is not None else recs


def corpus_description() -> dict[str, Any]:
    return {"python": sys.version.split()[0], "stdlib": str(stdlib_dir())}


__all__ = ["build_corpus", "code_records", "corpus_description", "passages", "prose_records"]
