"""`bench --task`: task scores of every method's outputs and the paired comparison of each
method with strict decoding (the target's own greedy output), with the label-free warnings.

marscli/jobs/bench.py calls `task_report` once the runs are in (scoring is not timed) and
marscli/bench/report.py calls `render_task_table`; everything else about task scores lives in
marscli.scoring. Figures: marscli.scoring.stats; the table: docs/bench.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from marscli.errors import UsageError
from marscli.scoring import humaneval, rouge, stats
from marscli.scoring.tasks import (
    BINARY_TASKS,
    HUMANEVAL,
    SCORE_NAMES,
    SUM,
    TaskItem,
    check_task,
    score_items,
)

#: Methods a task comparison is made against, in order of preference (all equal strict's
#: greedy output token for token; bench checks that).
BASELINE_KINDS = ("strict", "ar", "hf-generate")


def check_ready(task: str | None, method_kinds: Sequence[str]) -> None:
    """Refuse before an hour of decoding what would only fail when scoring."""
    if task is None:
        return
    check_task(task)
    if not any(k in BASELINE_KINDS for k in method_kinds):
        raise UsageError("--task compares methods with strict decoding: add strict (or ar, hf-generate) to --methods")
    if task == HUMANEVAL:
        humaneval.data_path()
    if task == SUM:
        if not rouge.rouge_available():
            raise UsageError("--task sum needs rouge-score: pip install 'marscli[score]'")


def baseline_method(methods: Sequence[tuple[str, str]]) -> str:
    """The name of the method others are compared with: strict, else ar, else hf-generate."""
    for kind in BASELINE_KINDS:
        for name, k in methods:
            if k == kind:
                return name
    raise UsageError("--task needs strict, ar or hf-generate among the methods")


def _strip_eos(tokens: Sequence[int], eos: Sequence[int]) -> list[int]:
    return list(tokens[:-1]) if tokens and tokens[-1] in eos else list(tokens)


def task_report(task: str, runs: Sequence[Any], methods: Sequence[tuple[str, str]],
                decode: Callable[[list[int]], str], eos_ids: Sequence[int], max_tokens: int,
                *, workers: int | None = None) -> dict[str, Any]:
    """Score every run and compare every method with the baseline, paired by (prompt, seed).

    `runs`: bench Runs (method, prompt with id and reference, seed, tokens, and `seconds`:
    the run's generation time, prefill included); `methods`: (name, kind) in table order.
    Time per task, per method: `seconds_per_record` (mean of its runs' seconds) and
    `task_speedup_vs_baseline` (the baseline's seconds / the method's, summed over the
    (record, seed) pairs both ran, scored or not); None when the runs carry no seconds.
    """
    base = baseline_method(methods)
    texts = [decode(r.tokens) for r in runs]
    items = [TaskItem(r.prompt.id, [text], r.prompt.reference) for r, text in zip(runs, texts)]
    scores = score_items(task, items, workers=workers)
    by_method: dict[str, dict[tuple[str, int], tuple[Any, Any]]] = {}
    for r, s in zip(runs, scores):
        by_method.setdefault(r.method, {})[(r.prompt.id, r.seed)] = (r, s)
    base_runs = by_method.get(base, {})
    out_methods: dict[str, dict[str, Any]] = {}
    for name, _kind in methods:
        mine = by_method.get(name, {})
        keys = [k for k in mine if mine[k][1].score is not None]
        own = stats.mean_ci([mine[k][1].score for k in keys], binary=task in BINARY_TASKS)
        entry: dict[str, Any] = {**own.to_json(), "unscored": len(mine) - len(keys)}
        toks = [mine[k][0].tokens for k in mine]
        entry["truncated_share"] = stats.share(
            [len(t) >= max_tokens and not (t and t[-1] in eos_ids) for t in toks])
        entry["loop_share"] = stats.share([stats.ends_in_loop(_strip_eos(t, eos_ids)) for t in toks])
        entry.update(_time_per_task(mine, base_runs))
        paired = [k for k in keys if k in base_runs and base_runs[k][1].score is not None]
        if name != base:
            comp = stats.compare([mine[k][1].score for k in paired], [base_runs[k][1].score for k in paired])
            base_len = sum(len(base_runs[k][0].tokens) for k in paired)
            comp["length_ratio"] = (sum(len(mine[k][0].tokens) for k in paired) / base_len) if base_len else None
            comp["verdict"] = stats.verdict(comp)
            entry["vs_baseline"] = comp
        out_methods[name] = entry
    # The text of every output, so that a flip can be read, not only counted.
    records = [{"method": r.method, "id": r.prompt.id, "seed": r.seed, "score": s.score, **s.to_json(), "output": text}
               for r, s, text in zip(runs, scores, texts)]
    return {"task": task, "score_name": SCORE_NAMES[task], "baseline": base, "methods": out_methods,
            "records": records,
            "notes": [f"{SCORE_NAMES[task]} per method with its 95% CI; vs {base}: paired bootstrap 95% CI of "
                      "the difference over the same records, flips down/up, recovery = method / "
                      f"{base}; a difference whose CI contains 0 is inside the noise"]}


def _time_per_task(mine: dict[tuple[str, int], tuple[Any, Any]],
                   base: dict[tuple[str, int], tuple[Any, Any]]) -> dict[str, float | None]:
    """seconds_per_record and task_speedup_vs_baseline of one method (see task_report)."""
    seconds = {k: getattr(run, "seconds", None) for k, (run, _) in mine.items()}
    base_seconds = {k: getattr(run, "seconds", None) for k, (run, _) in base.items()}
    if not seconds or None in seconds.values():
        return {"seconds_per_record": None, "task_speedup_vs_baseline": None}
    paired = [k for k in seconds if base_seconds.get(k) is not None]
    mine_s, base_s = sum(seconds[k] for k in paired), sum(base_seconds[k] for k in paired)
    return {"seconds_per_record": sum(seconds.values()) / len(seconds),
            "task_speedup_vs_baseline": base_s / mine_s if paired and mine_s > 0 else None}


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _ci(pair: Sequence[float] | None, spec: str) -> str:
    return "" if not pair else f" [{format(pair[0], spec)}, {format(pair[1], spec)}]"


def render_task_table(task: dict[str, Any], console) -> None:
    """The task table on stderr: per method its score, and against the baseline the paired
    difference, flips, recovery and the warnings, with a plain verdict."""
    from rich.table import Table

    base = task["baseline"]
    name = task["score_name"]
    t = Table(title=f"task {task['task']}: {name}, each method against {base} on the same records",
              title_justify="left")
    timed = any(a.get("seconds_per_record") is not None for a in task["methods"].values())
    time_cols = ("s/record", f"task x {base}") if timed else ()
    for col in ("method", f"{name} [95% CI]", "n", f"diff vs {base} [95% CI]", "down/up", "recovery [95% CI]",
                "length ratio", *time_cols, "truncated", "loops", "verdict"):
        t.add_column(col, justify="left" if col in ("method", "verdict") else "right")
    for method, a in task["methods"].items():
        c = a.get("vs_baseline")
        time_cells = ([_f(a.get("seconds_per_record"), ".3f"), _f(a.get("task_speedup_vs_baseline"), ".2f")]
                      if timed else [])
        if c is None:
            row = ["-", "-", "-", "1.00", *time_cells, _f(a["truncated_share"], ".2f"), _f(a["loop_share"], ".2f"),
                   "baseline"]
        else:
            if not c["flips"]["down"] and not c["flips"]["up"]:
                noise = "same scores"
            else:
                noise = "inside the noise" if c["inside_noise"] else ("worse" if c["diff"] < 0 else "better")
            row = [_f(c["diff"], "+.3f") + _ci(c["diff_ci95"], "+.3f"), f"{c['flips']['down']}/{c['flips']['up']}",
                   _f(c["recovery"], ".3f") + _ci(c["recovery_ci95"], ".3f"), _f(c["length_ratio"], ".2f"),
                   *time_cells, _f(a["truncated_share"], ".2f"), _f(a["loop_share"], ".2f"), noise]
        t.add_row(method, _f(a["mean"], ".3f") + _ci(a["ci95"], ".3f"), str(a["n"]), *row)
    console.print(t)
    for method, a in task["methods"].items():
        c = a.get("vs_baseline")
        if c is not None:
            console.print(f"{method} vs {base}: {c['verdict']}", markup=False, soft_wrap=True)
