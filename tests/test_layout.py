"""The package's shape, as docs/architecture.md draws it: the root holds only the faces, every
import runs down the layers (or sideways within one), no import circle closes anywhere, and
marscli's own imports sit at the top of their modules except where a face keeps `--help` and
`import marscli` light."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "marscli"

#: The layers of docs/architecture.md, top first. A module belongs to the first unit whose
#: name is its own or a package above it. An import may go to its own layer or a lower one.
LAYERS = (
    ("marscli", "marscli.__main__", "marscli.cli", "marscli.api", "marscli.lmeval"),  # the faces
    ("marscli.jobs",),
    ("marscli.bench", "marscli.calibration", "marscli.scoring", "marscli.training"),
    ("marscli.engine",),
    ("marscli.drafters",),
    ("marscli.verification", "marscli.models", "marscli.io", "marscli.heads"),
    ("marscli.config", "marscli.errors", "marscli._version", "marscli.verification.registry",
     "marscli.verification.guard", "marscli.drafters.kinds"),
)
#: The root's modules: the faces, the settings values, the errors, the version.
ROOT_MODULES = {"__init__", "__main__", "_version", "api", "cli", "config", "errors", "lmeval"}
#: Where marscli imports may sit inside a function, and why: the faces import the jobs in
#: command bodies and API calls so that `marscli --help` and `import marscli` (marscli.LLM
#: included) never import torch and transformers (about 2 s; tests/cli/test_api.py,
#: tests/cli/test_cli.py). Everywhere else imports sit at the top of the module.
LAZY_IMPORTS_ALLOWED = {"marscli", "marscli.cli", "marscli.api"}


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = modules()


def imported(node: ast.AST) -> list[str]:
    """marscli modules an import statement loads (`from marscli.x import y` loads marscli.x.y
    when that is a module)."""
    out = []
    if isinstance(node, ast.Import):
        out += [a.name for a in node.names if a.name.split(".")[0] == "marscli"]
    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
            node.module.split(".")[0] == "marscli":
        out.append(node.module)
        out += [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES]
    return [m for m in out if m in MODULES]


def edges() -> dict[str, set[str]]:
    return {name: {m for node in ast.walk(tree) for m in imported(node) if m != name}
            for name, tree in MODULES.items()}


def layer(name: str) -> int:
    best = None
    for i, units in enumerate(LAYERS):
        for unit in units:
            if (name == unit or name.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (i, unit)
    assert best is not None, f"{name} is in no layer of docs/architecture.md"
    return best[0]


def test_the_root_holds_only_the_faces():
    root = {p.stem for p in PACKAGE.glob("*.py")}
    assert root == ROOT_MODULES, f"move {sorted(root - ROOT_MODULES)} into the package of its concept"


def test_every_module_sits_in_a_layer():
    for name in MODULES:
        layer(name)


def test_imports_run_down_the_layers():
    up = [f"{a} (layer {layer(a)}) imports {b} (layer {layer(b)})"
          for a, targets in edges().items() for b in sorted(targets)
          if layer(b) < layer(a) and not b == "marscli"]
    assert not up, "\n".join(up)


def test_the_package_itself_is_imported_by_the_faces_only():
    # `from marscli import X` runs marscli/__init__ (the lazy API); below the faces, the
    # version comes from marscli._version
    users = sorted(a for a, targets in edges().items() if "marscli" in targets and layer(a) > 0)
    assert not users, users


def test_no_import_circle():
    graph = edges()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


def test_no_circle_between_packages():
    def unit(name: str) -> str:
        if name in ("marscli.verification.registry", "marscli.verification.guard", "marscli.drafters.kinds"):
            return name
        parts = name.split(".")
        return ".".join(parts[:2])

    graph: dict[str, set[str]] = {}
    for a, targets in edges().items():
        graph.setdefault(unit(a), set()).update(unit(b) for b in targets if unit(b) != unit(a))
    faces = {"marscli", "marscli.__main__", "marscli.cli", "marscli.api", "marscli.lmeval"}
    # a package circle = some package reaches itself again
    for start in graph:
        if start in faces:
            continue
        seen, todo = set(), list(graph[start] - faces)
        while todo:
            u = todo.pop()
            if u == start:
                raise AssertionError(f"{start} reaches itself through its imports")
            if u not in seen:
                seen.add(u)
                todo += list(graph.get(u, ()) - faces)


def test_marscli_imports_sit_at_module_top():
    inside = []
    for name, tree in MODULES.items():
        if name in LAZY_IMPORTS_ALLOWED:
            continue
        for fn in ast.walk(tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [f"{name}.{fn.name}: {m}" for node in ast.walk(fn) for m in imported(node)]
    assert not inside, "\n".join(inside)


def test_no_private_name_crosses_a_module():
    crossing = [f"{name}: from {node.module} import {a.name}"
                for name, tree in MODULES.items() for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("marscli")
                for a in node.names if a.name.startswith("_") and a.name != "__version__"]
    assert not crossing, crossing


def test_help_loads_no_torch():
    """Every command's --help stays fast: no torch, no transformers (the faces keep the jobs in
    command bodies; `main` catches the signal stop from marscli.errors)."""
    import subprocess
    import sys

    code = ("import sys\nfrom marscli.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['calibrate', '--help'], ['bench', '--help'],\n"
            "             ['score', '--help'], ['models', '--help'], ['profile', 'list', '--help']):\n"
            "    sys.argv = ['marscli', *argv]\n"
            "    try:\n"
            "        main()\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (argv, e.code)\n"
            "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
