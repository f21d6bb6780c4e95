"""bench's time per task on hand-made runs: seconds per record, the task speed-up and length
ratio against ar / hf-generate / strict (paired by record and seed), their spread over seeds,
the report table's columns and the one-line verdicts. No model, no timing."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from marscli.bench import methods as bench_mod
from marscli.bench.methods import BenchConfig, BenchPrompt, Run, parse_methods, summarize
from marscli.bench.report import render_tables, time_verdicts
from marscli.config import DraftConfig, ModelConfig

PROMPTS = [BenchPrompt("a", 1, [1, 2, 3], None), BenchPrompt("b", 2, [4, 5], None)]
#: Per method: (completion tokens, seconds) of every run. mars writes answers 3x as long as
#: ar's at 2x its tokens/s: 2/3 of ar's speed per task. strict: 1.25x ar both ways.
SHAPES = {"ar": (10, 1.0), "strict": (10, 0.8), "mars@0.9": (30, 1.5)}


def config(methods: str = "ar,strict,mars", seeds=(0,), temperature: float = 0.0) -> BenchConfig:
    return BenchConfig(input="-", methods=parse_methods(methods, (0.9,)), target=ModelConfig(),
                       draft=DraftConfig(kind="ngram"), seeds=tuple(seeds), temperature=temperature)


def runs_for(shapes, seeds=(0,), prompts=PROMPTS, slow_seed: dict[int, float] | None = None) -> list[Run]:
    """One run per method x prompt x seed; `slow_seed[s]` multiplies mars's seconds at seed s."""
    out = []
    for seed in seeds:
        for p in prompts:
            for name, (n, seconds) in shapes.items():
                factor = (slow_seed or {}).get(seed, 1.0) if name.startswith("mars") else 1.0
                out.append(Run(name, p, seed, list(range(n)), seconds * factor, n))
    return out


def test_longer_answers_win_tokens_per_s_and_lose_time_per_task():
    m = summarize(config(), runs_for(SHAPES), None)
    ar, strict, mars = m["ar"], m["strict"], m["mars@0.9"]
    assert mars["seconds_per_record"] == pytest.approx(1.5) and ar["seconds_per_record"] == pytest.approx(1.0)
    assert mars["mean_completion_tokens"] == pytest.approx(30) and ar["mean_completion_tokens"] == pytest.approx(10)
    assert mars["speedup_vs_ar"] == pytest.approx(2.0)
    assert mars["task_speedup_vs_ar"] == pytest.approx(2 / 3)
    assert mars["length_ratio_vs_ar"] == pytest.approx(3.0)
    # against strict: faster in tokens/s (20 vs 12.5), slower per task (0.8 s vs 1.5 s)
    assert mars["speedup_vs_strict"] == pytest.approx(1.6)
    assert mars["task_speedup_vs_strict"] == pytest.approx(0.8 / 1.5)
    assert mars["length_ratio_vs_strict"] == pytest.approx(3.0)
    assert strict["task_speedup_vs_ar"] == pytest.approx(1.25) and strict["length_ratio_vs_ar"] == pytest.approx(1.0)
    assert ar["task_speedup_vs_ar"] == 1.0 and strict["task_speedup_vs_strict"] == 1.0
    # no hf-generate among the methods: no ratio against it
    assert all(a["task_speedup_vs_hf_generate"] is None and a["length_ratio_vs_hf_generate"] is None
               for a in m.values())


def test_task_speedup_is_paired_by_record_and_seed():
    runs = runs_for(SHAPES)
    # an extra mars run on a record ar never ran: counted in mars's own seconds per record,
    # left out of the comparison with ar
    extra = BenchPrompt("c", 3, [6], None)
    runs.append(Run("mars@0.9", extra, 0, list(range(5)), 100.0, 5))
    mars = [r for r in runs if r.method == "mars@0.9"]
    ar = [r for r in runs if r.method == "ar"]
    task, length = bench_mod.paired_time_ratios(mars, ar)
    assert task == pytest.approx(2 / 3) and length == pytest.approx(3.0)
    assert bench_mod.paired_time_ratios(mars, []) == (None, None)


def test_time_per_task_is_averaged_over_seeds_with_its_spread():
    cfg = config(seeds=(0, 1), temperature=1.0)
    m = summarize(cfg, runs_for(SHAPES, seeds=(0, 1), slow_seed={1: 2.0}), None)
    mars = m["mars@0.9"]
    # seed 0: 1.0 / 1.5; seed 1: 1.0 / 3.0
    per_seed = [1.0 / 1.5, 1.0 / 3.0]
    assert [s["task_speedup_vs_ar"] for s in mars["seeds"]] == pytest.approx(per_seed)
    assert mars["task_speedup_vs_ar"] == pytest.approx(sum(per_seed) / 2)
    assert mars["spread"]["task_speedup_vs_ar"] == pytest.approx(abs(per_seed[0] - per_seed[1]) / 2 ** 0.5)
    assert mars["seconds_per_record"] == pytest.approx((1.5 + 3.0) / 2)
    assert mars["spread"]["seconds_per_record"] is not None
    assert mars["length_ratio_vs_strict"] == pytest.approx(3.0) and mars["spread"]["length_ratio_vs_strict"] == 0
    for f in ("seconds_per_record", "mean_completion_tokens", "task_speedup_vs_ar", "task_speedup_vs_strict",
              "length_ratio_vs_ar", "length_ratio_vs_strict"):
        assert f in bench_mod.SPREAD_FIELDS


def test_verdicts_say_when_a_method_is_slower_per_task():
    lines = time_verdicts(summarize(config(), runs_for(SHAPES), None))
    assert lines == [
        "strict: 1.25x tokens/s and 1.25x per task vs ar (answers 1.00x as long)",
        "mars@0.9: 2.00x tokens/s but 0.67x per task vs ar (answers 3.00x as long); slower per task than ar: "
        "its answers are longer; slower per task than strict: its answers are longer (1.60x tokens/s but "
        "0.53x per task, answers 3.00x as long)",
    ]


def test_verdicts_against_hf_generate_or_strict_when_there_is_no_ar():
    shapes = {"hf-generate": (10, 1.0), "strict": (10, 0.8), "mars@0.9": (12, 0.9)}
    lines = time_verdicts(summarize(config("hf-generate,strict,mars"), runs_for(shapes), None))
    # mars: 13.3 tok/s vs strict's 12.5 (faster) but 0.9 s per record vs 0.8 (slower)
    assert lines[0] == "strict: 1.25x tokens/s and 1.25x per task vs hf-generate (answers 1.00x as long)"
    assert lines[1].startswith("mars@0.9: 1.33x tokens/s but 1.11x per task vs hf-generate (answers 1.20x as long)")
    assert "; slower per task than strict: its answers are longer (1.07x tokens/s but 0.89x per task" in lines[1]
    assert "than hf-generate" not in lines[1]
    lines = time_verdicts(summarize(config("strict,mars"), runs_for({k: shapes[k] for k in ("strict", "mars@0.9")}),
                                    None))
    assert lines == ["mars@0.9: 1.07x tokens/s but 0.89x per task vs strict (answers 1.20x as long); "
                     "slower per task than strict: its answers are longer"]
    assert time_verdicts(summarize(config("mars"), runs_for({"mars@0.9": shapes["mars@0.9"]}), None)) == []


def minimal_report(methods: dict) -> dict:
    return {
        "settings": {"temperature": 0.0, "seeds": [0], "max_tokens": 32,
                     "drafter": {"kind": "ngram", "model": None, "num_draft_tokens": 4}},
        "prompts": {"used": 2}, "target": {"name": "tiny"}, "environment": {"device": "cpu"},
        "methods": methods, "throughput": [],
        "physical_limit": {"context_tokens": 3, "t_1_s": 0.01, "t_k_plus_1_s": 0.02, "target_forward_s": {"1": 0.01}},
        "correctness": {"checked": False}, "task": None, "notes": [],
    }


def test_table_shows_seconds_per_record_and_task_speedup_then_the_verdicts():
    buf = io.StringIO()
    console = Console(file=buf, width=250, highlight=False)
    render_tables(minimal_report(summarize(config(), runs_for(SHAPES), None)), console)
    text = buf.getvalue()
    header = next(line for line in text.splitlines() if "tok/s" in line)
    assert "s/record" in header and "task x ar" in header and "task x hf-gen" not in header  # no hf-generate
    assert header.index("tok/s") < header.index("s/record") < header.index("task x ar")
    mars_row = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("mars@0.9"))
    assert "1.500" in mars_row and "0.67" in mars_row and "2.00" in mars_row
    assert "mars@0.9: 2.00x tokens/s but 0.67x per task vs ar" in text
    assert text.index("task x ar") < text.index("slower per task than strict: its answers are longer")


def test_table_shows_the_task_speedup_vs_hf_generate_when_there_is_no_ar():
    shapes = {"hf-generate": (10, 1.0), "ar": (10, 1.1), "mars@0.9": (12, 0.9)}
    for methods, want, absent in (("hf-generate,mars", "task x hf-gen", "task x ar"),
                                  ("hf-generate,ar,mars", "task x ar", "task x hf-gen")):
        buf = io.StringIO()
        names = methods.replace("mars", "mars@0.9").split(",")
        runs = runs_for({k: shapes[k] for k in names})
        render_tables(minimal_report(summarize(config(methods), runs, None)), Console(file=buf, width=250))
        text = buf.getvalue()
        assert want in text and absent not in text, methods
