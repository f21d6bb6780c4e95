"""marscli.scoring.humaneval: extraction, execution, and what a completion cannot do to the host."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from marscli.scoring import humaneval as he

#: HumanEval/0-7 as the prompt sets hold them, shipped with the repository (examples/README.md).
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "humaneval.jsonl"
FAST = he.Limits(timeout_s=5.0)


@pytest.fixture(scope="module")
def problems() -> dict[str, he.Problem]:
    return he.load_problems()


def test_every_canonical_solution_passes(problems):
    assert len(problems) == 164
    jobs = [(p, p.canonical_solution) for p in problems.values()]
    outcomes = he.check_many(jobs, he.Limits(timeout_s=20.0), workers=4)
    failed = [(p.task_id, o.result) for (p, _), o in zip(jobs, outcomes) if not o.passed]
    assert failed == []  # pass@1 = 1.0 over all 164


def test_the_prompt_set_is_humaneval(problems):
    recs = [json.loads(line) for line in PROMPTS.open()]
    assert [r["question_id"] for r in recs] == list(range(8))
    for r in recs:
        p = problems[he.task_id(r["question_id"])]
        assert r["turns"][0].endswith(p.prompt)


def test_a_wrong_solution_fails(problems):
    p = problems["HumanEval/0"]
    out = he.check_completion(p, "    return False\n", FAST)
    assert not out.passed and out.result == "AssertionError" and out.code_origin == "raw-body"
    syntax = he.check_completion(p, "    return (\n", FAST)
    assert not syntax.passed and "SyntaxError" in syntax.result
    assert he.check_completion(p, None).result == "no output"


def test_an_infinite_loop_fails_by_timeout_without_hanging(problems):
    p = problems["HumanEval/0"]
    t0 = time.monotonic()
    out = he.check_completion(p, "    while True:\n        pass\n", he.Limits(timeout_s=1.5))
    assert not out.passed and out.result == "timed out after 1.5 s"
    assert time.monotonic() - t0 < 30  # killed, not waited for (generous: the machine may be loaded)


def test_a_memory_hog_fails_inside_its_limit(problems):
    out = he.check_completion(problems["HumanEval/0"], "    x = bytearray(2 * 1024 ** 3)\n    return True\n",
                              he.Limits(timeout_s=10.0, memory_mb=256))
    assert not out.passed and "MemoryError" in out.result


def test_the_child_sees_none_of_the_callers_environment(monkeypatch):
    monkeypatch.setenv("MARSCLI_TEST_SECRET", "hunter2")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "also-secret")
    program = ("import os\n"
               "assert 'MARSCLI_TEST_SECRET' not in os.environ, 'leaked'\n"
               "assert 'AWS_SECRET_ACCESS_KEY' not in os.environ, 'leaked'\n"
               "assert os.environ['HOME'] == os.getcwd()\n")
    assert he.run_program(program, FAST).passed
    # And the other way round: code that needs the secret cannot pass.
    leak = he.run_program("import os\nassert os.environ.get('MARSCLI_TEST_SECRET') == 'hunter2'\n", FAST)
    assert not leak.passed and "AssertionError" in leak.result


def test_writes_outside_the_temporary_directory_do_not_land(tmp_path, monkeypatch, problems):
    monkeypatch.chdir(tmp_path)
    keep = tmp_path / "keep.txt"
    keep.write_text("precious")
    target = tmp_path / "escaped.txt"
    completion = (
        "    import os, pathlib, shutil\n"
        "    open('relative.txt', 'w').write('x')\n"  # lands in the child's own directory
        f"    for attempt in (lambda: open({str(target)!r}, 'w').write('x'),\n"
        f"                    lambda: pathlib.Path({str(target)!r}).write_text('x'),\n"
        f"                    lambda: os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT),\n"
        f"                    lambda: os.remove({str(keep)!r}),\n"
        f"                    lambda: shutil.rmtree({str(tmp_path)!r}),\n"
        f"                    lambda: os.system('touch {target}')):\n"
        "        try:\n"
        "            attempt()\n"
        "        except PermissionError:\n"
        "            pass\n"
        "    return True\n"
    )
    out = he.check_completion(problems["HumanEval/0"], completion, FAST)
    assert not out.passed  # returns True for every input: the tests fail, but nothing escaped
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert keep.read_text() == "precious"


def test_the_childs_directory_is_removed_and_fresh(problems):
    program = ("import os\nassert sorted(os.listdir('.')) == ['.stderr', 'program.py']\n"
               "open('left.txt', 'w').write('x')\n")
    assert he.run_program(program, FAST).passed
    assert he.run_program(program, FAST).passed  # the second run does not see the first's file


FENCED_FULL = """Here is the completed function:

```python
from typing import List


def has_close_elements(numbers: List[float], threshold: float) -> bool:
    for i, a in enumerate(numbers):
        for j, b in enumerate(numbers):
            if i != j and abs(a - b) < threshold:
                return True
    return False
```

Example usage:

```python
print(has_close_elements([1.0, 2.0], 0.5))
assert False  # an example block must never run as the answer
```
"""


def test_extraction_takes_the_first_block_that_defines_the_function(problems):
    p = problems["HumanEval/0"]
    code, origin = he.extract_code(FENCED_FULL, p.entry_point)
    assert origin == "fenced" and "def has_close_elements" in code and "assert False" not in code
    out = he.check_completion(p, FENCED_FULL, FAST)
    assert out.passed and out.code_origin == "fenced-function"
    # The example first, the function second: still the function's block.
    blocks = FENCED_FULL.split("Example usage:")
    swapped = "```python\nprint(1)\n```\n" + blocks[0]
    assert he.check_completion(p, swapped, FAST).passed


def test_extraction_of_an_unclosed_fence_and_of_bare_restated_functions(problems):
    p = problems["HumanEval/0"]
    body = p.canonical_solution
    unclosed = "Sure:\n```python\n" + p.prompt + body  # cut at max tokens before the closing fence
    assert he.check_completion(p, unclosed, FAST).passed
    bare = p.prompt + body  # no fence, the whole function restated
    out = he.check_completion(p, bare, FAST)
    assert out.passed and out.code_origin == "raw-function"
    # A fenced block holding only the body continues the prompt.
    assert he.check_completion(p, "```python\n" + body + "```\n", FAST).code_origin == "fenced-body"


def test_an_answers_main_block_does_not_run(problems):
    p = problems["HumanEval/0"]
    answer = ("```python\n" + p.prompt + p.canonical_solution
              + "\n\nif __name__ == '__main__':\n    input('numbers? ')\n    raise SystemExit(1)\n```")
    assert he.check_completion(p, answer, FAST).passed


def test_a_restated_function_keeps_the_prompts_helpers(problems):
    # HumanEval/10's prompt defines is_palindrome, which make_palindrome's solution calls.
    p = problems["HumanEval/10"]
    answer = "```python\ndef make_palindrome(string: str) -> str:\n" + p.canonical_solution + "```"
    assert he.check_completion(p, answer, FAST).passed


@pytest.mark.parametrize(("rid", "tid"), [(7, "HumanEval/7"), ("7", "HumanEval/7"), ("HumanEval/7", "HumanEval/7"),
                                         ("x7", None), (True, None), (None, None)])
def test_task_ids(rid, tid):
    assert he.task_id(rid) == tid


def test_bad_problems_file_is_one_line_error(tmp_path):
    from marscli.errors import UsageError

    f = tmp_path / "p.jsonl"
    f.write_text('{"task_id": "HumanEval/0"}\n')
    with pytest.raises(UsageError, match=r"p.jsonl:1: not a HumanEval problem"):
        he.load_problems(str(f))
