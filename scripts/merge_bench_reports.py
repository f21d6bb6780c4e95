"""Merge `marscli bench --task` reports measured in chunks (disjoint records, same settings)
into one table, as if one run had measured every record.

    python scripts/merge_bench_reports.py A.json B.json [...] [--report merged.json]

Why: on a CPU the Qwen2.5-Coder pair decodes at ~2-3 tokens/s, so a 40-problem table with
four methods takes longer than one session; scripts/bench_qwen_task.sh (SKIP=...) measures it
in chunks. Every chunk must come from the same settings (methods, max tokens, thetas, target,
draft, guard, task); the script refuses otherwise, and refuses overlapping records.

Per method it sums the counters (completion tokens, generation seconds, steps, drafts,
acceptances, relaxations) and recomputes tokens/s, speed-up over ar, time per task
(seconds per record, and the task speed-up and length ratio against ar, strict and
hf-generate), tau (tokens per verification step) and the relaxed share; per task it
recomputes the mean with its 95% CI, seconds per record and the task speed-up over the
baseline, and against the baseline the paired bootstrap CI of the difference, flips, recovery, length
ratio, truncated share and loop share, with the same functions bench uses
(marscli.scoring.stats). The table goes to stdout as Markdown.

--quality-only merges chunks whose method lists differ (say, later chunks leave out ar or a
theta to save time) or that were timed with different kernels: it keeps the methods every chunk
ran, requires the other settings to match as before, and reports no speed (tok/s, speed-up,
seconds per record; length ratios stay):
summed seconds from different method lists or kernels are not one measurement. tau and the
relaxed share are still counted over the merged runs.

Two figures are approximations, said in the output: an output counts as truncated when its
completion tokens reach max tokens (bench itself also checks the end-of-sequence token), and
the speed-up is the ratio of summed tokens over summed seconds, each chunk having been timed
on an idle machine (bench's own figure is the same ratio within one run).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from marscli.scoring import stats
from marscli.scoring.tasks import BINARY_TASKS

SAME = ("methods", "max_tokens", "temperature", "seeds", "margin", "thetas", "guard", "drafter")
QUALITY_ONLY_FREE = ("methods", "thetas")  # may differ between chunks under --quality-only
#: Reference methods of the time-per-task ratios: (field suffix, method kind), as in bench.
REFERENCES = (("hf_generate", "hf-generate"), ("ar", "ar"), ("strict", "strict"))
COUNTERS = ("completion_tokens", "seconds", "target_forwards", "steps", "drafted", "accepted", "relaxed")


def fail(msg: str) -> None:
    print(f"merge_bench_reports: {msg}", file=sys.stderr)
    raise SystemExit(2)


def load(paths: list[str], quality_only: bool = False) -> list[dict[str, Any]]:
    reports = []
    for p in paths:
        with open(p, encoding="utf-8") as f:
            r = json.load(f)
        if not r.get("task"):
            fail(f"{p}: no task section (run bench with --task)")
        reports.append(r)
    first = reports[0]
    for p, r in zip(paths[1:], reports[1:]):
        for key in SAME:
            if quality_only and key in QUALITY_ONLY_FREE:
                continue
            if r["settings"].get(key) != first["settings"].get(key):
                fail(f"{p}: settings.{key} differs from {paths[0]}: {r['settings'].get(key)!r} "
                     f"vs {first['settings'].get(key)!r}")
        for key in ("target", "draft"):
            a, b = (r.get(key) or {}), (first.get(key) or {})
            if (a.get("sha256"), a.get("dtype")) != (b.get("sha256"), b.get("dtype")):
                fail(f"{p}: {key} differs from {paths[0]}")
        if r["task"]["task"] != first["task"]["task"]:
            fail(f"{p}: task {r['task']['task']} differs from {first['task']['task']}")
        if r["task"]["baseline"] != first["task"]["baseline"]:
            fail(f"{p}: baseline {r['task']['baseline']} differs from {first['task']['baseline']}")
    seen: dict[str, str] = {}
    for p, r in zip(paths, reports):
        for rid in {run["id"] for run in r["runs"]}:
            if rid in seen:
                fail(f"record id {rid!r} is in both {seen[rid]} and {p}")
            seen[rid] = p
    return reports


def common_methods(reports: list[dict[str, Any]]) -> list[str]:
    """The methods every report ran, in the first report's order; the baseline must be one."""
    names = [n for n in reports[0]["methods"] if all(n in r["methods"] for r in reports)]
    base = reports[0]["task"]["baseline"]
    if base not in names:
        fail(f"the baseline {base} is not in every report")
    return names


def merge(reports: list[dict[str, Any]], quality_only: bool = False) -> dict[str, Any]:
    settings = dict(reports[0]["settings"])
    max_tokens = settings["max_tokens"]
    task = reports[0]["task"]["task"]
    base = reports[0]["task"]["baseline"]
    names = common_methods(reports)
    if quality_only:
        settings["methods"] = names
        settings["thetas"] = sorted({reports[0]["methods"][n]["theta"] for n in names
                                     if reports[0]["methods"][n].get("theta") is not None})
    runs = [run for r in reports for run in r["runs"] if run["method"] in names]
    runs = [run for r in reports for run in r["runs"]]
    by_method: dict[str, dict[tuple[str, int], dict[str, Any]]] = defaultdict(dict)
    for run in runs:
        by_method[run["method"]][(run["id"], run["seed"])] = run
    scores: dict[str, dict[tuple[str, int], float | None]] = defaultdict(dict)
    for r in reports:
        for rec in r["task"]["records"]:
            scores[rec["method"]][(rec["id"], rec["seed"])] = rec["score"]
    methods: dict[str, dict[str, Any]] = {}
    for name in names:
        summed = {c: sum((r["methods"][name].get(c) or 0) for r in reports) for c in COUNTERS}
        kind = reports[0]["methods"][name]["kind"]
        m: dict[str, Any] = {"kind": kind, "theta": reports[0]["methods"][name].get("theta"),
                             "runs": sum(r["methods"][name]["runs"] for r in reports), **summed}
        timed = summed["seconds"] and not quality_only
        m["tokens_per_s"] = summed["completion_tokens"] / summed["seconds"] if timed else None
        m["acceptance_length"] = (summed["completion_tokens"] / summed["steps"]) if summed["steps"] else None
        m["relaxed_share"] = (summed["relaxed"] / summed["completion_tokens"]) if summed["steps"] else None
        m["seconds_per_record"] = summed["seconds"] / m["runs"] if timed and m["runs"] else None
        m["mean_completion_tokens"] = summed["completion_tokens"] / m["runs"] if m["runs"] else None
        methods[name] = m
    ar = next((n for n in names if methods[n]["kind"] == "ar"), None)
    for m in methods.values():
        m["speedup_vs_ar"] = (m["tokens_per_s"] / methods[ar]["tokens_per_s"]) if ar and m["tokens_per_s"] else None
        add_time_ratios(m, methods)
    base_scores = scores[base]
    for name in names:
        mine = scores[name]
        keys = [k for k in mine if mine[k] is not None]
        own = stats.mean_ci([mine[k] for k in keys], binary=task in BINARY_TASKS)
        m = methods[name]
        m["task"] = {**own.to_json(), "unscored": len(mine) - len(keys)}
        mruns = by_method[name]
        m["task"]["truncated_share"] = stats.share([r["completion_tokens"] >= max_tokens for r in mruns.values()])
        m["task"]["loop_share"] = stats.share([bool(r.get("ends_in_loop")) for r in mruns.values()])
        if name != base:
            paired = sorted(k for k in keys if base_scores.get(k) is not None)
            comp = stats.compare([mine[k] for k in paired], [base_scores[k] for k in paired])
            base_len = sum(by_method[base][k]["completion_tokens"] for k in paired)
            comp["length_ratio"] = sum(mruns[k]["completion_tokens"] for k in paired) / base_len if base_len else None
            comp["verdict"] = stats.verdict(comp)
            m["task"]["vs_baseline"] = comp
        m["task"]["seconds_per_record"] = m["seconds_per_record"]
        m["task"]["task_speedup_vs_baseline"] = _ratio(methods[base]["seconds_per_record"], m["seconds_per_record"])
    notes = ["truncated: completion tokens reached max tokens (the EOS check of bench is not redone)"]
    if quality_only:
        dropped = sorted({n for r in reports for n in r["methods"]} - set(names))
        notes.append("quality only: no speed figures (the chunks' method lists or kernels may differ)"
                     + (f"; left out, not run in every chunk: {', '.join(dropped)}" if dropped else ""))
    else:
        notes.append("speed-up over ar: summed tokens / summed seconds per method, each chunk timed idle; "
                     "s/record: summed seconds / runs; task x ar: ar's s/record / the method's")
    return {"merged_from": len(reports), "task": task, "score_name": reports[0]["task"]["score_name"],
            "baseline": base, "settings": settings, "records": len({run["id"] for run in runs}),
            "quality_only": quality_only, "methods": methods, "notes": notes}


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def add_time_ratios(m: dict[str, Any], methods: dict[str, dict[str, Any]]) -> None:
    """task_speedup_vs_X (X's seconds per record / m's) and length_ratio_vs_X (m's completion
    tokens / X's) for X = ar, strict, hf-generate (the first method of that kind). Every
    chunk ran every kept method on each of its records, so the merged runs of two methods
    are the same records: bench's paired ratios are these ratios of sums."""
    for suffix, kind in REFERENCES:
        ref = next((r for r in methods.values() if r["kind"] == kind), None)
        m[f"task_speedup_vs_{suffix}"] = _ratio(ref["seconds_per_record"], m["seconds_per_record"]) if ref else None
        m[f"length_ratio_vs_{suffix}"] = _ratio(m["completion_tokens"], ref["completion_tokens"]) if ref else None


def _f(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def markdown(merged: dict[str, Any]) -> str:
    name, base = merged["score_name"], merged["baseline"]
    lines = [f"{merged['task']}: {merged['records']} records from {merged['merged_from']} reports, "
             f"max tokens {merged['settings']['max_tokens']}",
             "",
             f"| method | tok/s | x ar | s/record | task x ar | tau | relaxed/token | {name} [95% CI] | "
             f"diff vs {base} [95% CI] | down/up | recovery [95% CI] | length ratio | truncated | loops |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for mname, m in merged["methods"].items():
        t = m["task"]
        c = t.get("vs_baseline")
        ci = t.get("ci95") or [None, None]
        row = [mname, _f(m["tokens_per_s"], ".2f"), _f(m["speedup_vs_ar"], ".2f"), _f(m["seconds_per_record"], ".2f"),
               _f(m["task_speedup_vs_ar"], ".2f"), _f(m["acceptance_length"], ".2f"),
               _f(m["relaxed_share"], ".3f"), f"{_f(t['mean'], '.3f')} [{_f(ci[0], '.3f')}, {_f(ci[1], '.3f')}]"]
        if c is None:
            row += ["-", "-", "-", "1.00"]
        else:
            d, r = c.get("diff_ci95") or [None, None], c.get("recovery_ci95") or [None, None]
            row += [f"{_f(c['diff'], '+.3f')} [{_f(d[0], '+.3f')}, {_f(d[1], '+.3f')}]",
                    f"{c['flips']['down']}/{c['flips']['up']}",
                    f"{_f(c['recovery'], '.3f')} [{_f(r[0], '.3f')}, {_f(r[1], '.3f')}]",
                    _f(c["length_ratio"], ".2f")]
        row += [_f(t["truncated_share"], ".2f"), _f(t["loop_share"], ".2f")]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for mname, m in merged["methods"].items():
        c = m["task"].get("vs_baseline")
        if c is not None:
            lines.append(f"- {mname} vs {base}: {c['verdict']}")
    lines += [f"- note: {n}" for n in merged["notes"]]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--report", help="also write the merged figures as JSON here")
    ap.add_argument("--quality-only", action="store_true",
                    help="merge task scores of chunks whose method lists or kernels differ; no speed figures")
    a = ap.parse_args()
    merged = merge(load(a.reports, a.quality_only), a.quality_only)
    if a.report:
        with open(a.report, "w", encoding="utf-8") as f:
            json.dump(merged, f, indent=1)
    print(markdown(merged))


if __name__ == "__main__":
    main()
