#!/usr/bin/env python
"""The Markdown tables of marscli's measurement runs, one subcommand per kind of run:

    python scripts/report.py ratios bench.json            # a `bench --batch-size 1,4,...` report
    python scripts/report.py merge A.json B.json [...]    # `bench --task` reports measured in chunks
    python scripts/report.py quality OUTDIR --task humaneval --arms strict,mars   # generate arms, scored
    python scripts/report.py regime OUTDIR                # lab/scripts/bench_head_regime.sh's reports

## ratios

The ratios a `marscli bench --batch-size ...` report is read for: per batch size strict
and MARS against ar (plain decoding through marscli), and at batch size 1 strict against
transformers' prompt-lookup generation (hf-assisted with the ngram drafter), plus whether
strict's outputs equal ar's at every batch size.

    marscli bench prompts.jsonl --methods hf-generate,hf-assisted,ar,strict,mars \\
        --batch-size 1,4,8,16 --max-tokens 64 --report bench.json
    python scripts/report.py ratios bench.json

## merge

Merge `marscli bench --task` reports measured in chunks (disjoint records, same settings)
into one table, as if one run had measured every record.

    python scripts/report.py merge A.json B.json [...] [--report merged.json]

Why: on a CPU the Qwen2.5-Coder pair decodes at ~2-3 tokens/s, so a 40-problem table with
four methods takes longer than one session; lab/scripts/bench_qwen_task.sh (SKIP=...) measures it
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

## quality

The quality table of a set of generate runs over the same prompts (one results file per
arm, e.g. lab/scripts/quality_qwen_humaneval.sh's OUTDIR): every arm scored with `marscli score`
and compared with the baseline arm paired by record (pass@1 or accuracy with its 95% CI, the
paired difference with its bootstrap CI, flips both ways, recovery, length ratio), beside each
arm's decoding figures from its result lines (tokens per step, relaxed drafts per token,
truncated share) and its throughput from the wall times its log recorded.

    python scripts/report.py quality quality-qwen --task humaneval --arms strict,mars,mars-code,ratio

Each arm ARM is OUTDIR/ARM.jsonl (and OUTDIR/ARM.log, whose "wall seconds: S, exit code: C"
lines are summed: a run killed before that line leaves its wall time out, and the table says
so; "paused seconds: P" lines, written when a run was stopped with SIGSTOP so that the machine
could do something else, are subtracted). Writes OUTDIR/ARM.scored.jsonl and
OUTDIR/ARM.summary.json, prints the Markdown table (stdout) and writes OUTDIR/table.json.
Only records present in every arm are compared, so a table can be read while arms are still
running.

## regime

The Markdown table of lab/scripts/bench_head_regime.sh's reports: one row per drafter,
temperature and method with tokens/s, x ar, tau, the relaxed share of committed tokens, the
share of records identical to plain decoding's, the target's negative log-likelihood per
output token, the task score (ROUGE-L with TASK=sum) and its paired difference against strict, and seconds per
record; then each run's wall time from its log.

    python scripts/report.py regime OUTDIR
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from typing import Any

from marscli.scoring import stats
from marscli.scoring.tasks import BINARY_TASKS

# ---------------------------------------------------------------------------------- ratios

def cmd_ratios(args) -> int:
    """The ratios a `marscli bench --batch-size ...` report is read for."""
    report = json.load(open(args.report))
    rows = report.get("throughput") or []
    tp = {(r["method"], r["batch_size"]): r["tokens_per_s"] for r in rows}
    mars = sorted({m for m, _ in tp if m.startswith("mars")})
    print("| batch | ar | strict | " + " | ".join(mars) + " | strict / ar | "
          + " | ".join(f"{m} / ar" for m in mars) + " |")
    print("|---" * (3 + 2 * len(mars) + 1) + "|")
    for bs in sorted({b for _, b in tp}):
        ar, strict = tp.get(("ar", bs)), tp.get(("strict", bs))
        ms = [tp.get((m, bs)) for m in mars]

        def f(x):
            return "-" if x is None else f"{x:.1f}"

        def q(x, y):
            return "-" if x is None or not y else f"{x / y:.3f}"

        print(f"| {bs} | {f(ar)} | {f(strict)} | " + " | ".join(f(m) for m in ms)
              + f" | {q(strict, ar)} | " + " | ".join(q(m, ar) for m in ms) + " |")
    methods = report.get("methods") or {}
    s, h = (methods.get(k, {}).get("tokens_per_s") for k in ("strict", "hf-assisted"))
    if s and h:
        print(f"\nbatch 1, interleaved per prompt: strict {s:.1f} tokens/s, hf-assisted (prompt lookup) "
              f"{h:.1f} tokens/s, strict / hf-assisted = {s / h:.3f}")
    c = report.get("correctness") or {}
    print(f"correctness: {json.dumps(c)[:300]}")
    return 0



# ---------------------------------------------------------------------------------- merge

SAME = ("methods", "max_tokens", "temperature", "seeds", "margin", "thetas", "guard", "drafter")
QUALITY_ONLY_FREE = ("methods", "thetas")  # may differ between chunks under --quality-only
#: Reference methods of the time-per-task ratios: (field suffix, method kind), as in bench.
REFERENCES = (("hf_generate", "hf-generate"), ("ar", "ar"), ("strict", "strict"))
COUNTERS = ("completion_tokens", "seconds", "target_forwards", "steps", "drafted", "accepted", "relaxed")


def fail(msg: str) -> None:
    print(f"report.py merge: {msg}", file=sys.stderr)
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


def cmd_merge(args) -> int:
    """Merge chunked `bench --task` reports; print the Markdown table (and save JSON with --report)."""
    merged = merge(load(args.reports, args.quality_only), args.quality_only)
    if args.report:
        with open(args.report, "w", encoding="utf-8") as f:
            json.dump(merged, f, indent=1)
    print(markdown(merged))
    return 0


# ---------------------------------------------------------------------------------- quality

def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def rid(r: dict):
    for k in ("question_id", "id", "custom_id", "task_id"):
        if k in r:
            return r[k]
    raise SystemExit(f"a result line has no id key: {sorted(r)[:6]}")


def wall_seconds(log: str) -> tuple[float, int, int]:
    """Summed wall seconds of the runs that finished, runs that finished, runs started."""
    if not os.path.exists(log):
        return 0.0, 0, 0
    text = open(log, encoding="utf-8", errors="replace").read()
    walls = [int(m) for m in re.findall(r"^wall seconds: (\d+), exit code: \d+$", text, re.M)]
    # a run stopped (SIGSTOP) while the machine did something else, and how long: not its time
    paused = [int(m) for m in re.findall(r"^paused seconds: (\d+)$", text, re.M)]
    started = len(re.findall(r"^marscli: loaded ", text, re.M)) or len(walls)
    return float(sum(walls) - sum(paused)), len(walls), started


def cmd_quality(args) -> int:
    """Score every arm in OUTDIR, compare it with the baseline, print and save the table."""

    arms = [a for a in args.arms.split(",") if os.path.exists(os.path.join(args.outdir, f"{a}.jsonl"))]
    if args.baseline not in arms:
        raise SystemExit(f"no {args.baseline}.jsonl in {args.outdir}")
    lines = {a: {rid(r): r for r in read_jsonl(os.path.join(args.outdir, f"{a}.jsonl")) if r.get("output") is not None}
             for a in arms}
    common = set.intersection(*(set(v) for v in lines.values()))
    with tempfile.TemporaryDirectory(prefix="quality-table-") as tmp:
        rows = arm_rows(args, arms, lines, common, tmp)
    with open(os.path.join(args.outdir, "table.json"), "w", encoding="utf-8") as f:
        json.dump({"task": args.task, "records": len(common), "arms": rows}, f, indent=1)
        f.write("\n")
    print_table(args, rows)
    return 0


def arm_rows(args, arms: list[str], lines: dict, common: set, tmp: str) -> list[dict]:
    """Score every arm on the common records (written to tmp) and gather its figures."""
    paths = {}
    for a in arms:  # only the records every arm has, in the baseline's order
        paths[a] = os.path.join(tmp, f"{a}.jsonl")
        with open(paths[a], "w", encoding="utf-8") as f:
            for k in lines[args.baseline]:
                if k in common:
                    f.write(json.dumps(lines[a][k]) + "\n")
    rows = []
    for a in arms:
        summary = os.path.join(args.outdir, f"{a}.summary.json")
        cmd = [args.python, "-m", "marscli", "score", paths[a], "--task", args.task, "-q",
               "-o", os.path.join(args.outdir, f"{a}.scored.jsonl"), "--summary", summary]
        if args.prompts:
            cmd += ["--prompts", args.prompts]
        if a != args.baseline:
            cmd += ["--against", paths[args.baseline]]
        rc = subprocess.run(cmd).returncode
        if rc not in (0, 3):
            raise SystemExit(f"marscli score failed on {a} (exit {rc})")
        s = json.load(open(summary, encoding="utf-8"))
        recs = [lines[a][k] for k in common]
        tokens = sum(r["usage"]["completion_tokens"] for r in recs)
        steps = sum(r["spec"]["steps"] for r in recs)
        relaxed = sum(r["spec"]["relaxed"] for r in recs)
        truncated = sum(r.get("finish_reason") == "length" for r in recs)
        all_recs = list(lines[a].values())
        wall, finished, started = wall_seconds(os.path.join(args.outdir, f"{a}.log"))
        row = {"arm": a, "n": len(recs), "score": s.get("mean"), "ci95": s.get("ci95"),
               "tokens": tokens, "mean_tokens": tokens / len(recs) if recs else None,
               "tokens_per_step": tokens / steps if steps else None,
               "relaxed_per_token": relaxed / tokens if tokens else None,
               "truncated": truncated, "truncated_share": truncated / len(recs) if recs else None,
               "records_done": len(all_recs), "wall_s": wall, "runs_finished": finished, "runs_started": started,
               "seconds_per_record": wall / len(all_recs) if all_recs and wall and finished == started else None,
               "paired": s.get("paired")}
        rows.append(row)
    return rows


def print_table(args, rows: list[dict]) -> None:
    def ci(v):
        return f"[{v[0]:.3f}, {v[1]:.3f}]" if v else "-"

    print(f"| arm | n | {args.task} score [95% CI] | diff vs {args.baseline} [95% CI] | down / up | recovery | "
          "length ratio | tokens / step | relaxed / token | truncated | s / record |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        p = r["paired"]
        if p:
            d = p["diff_ci95"]
            diff = f"{p['diff']:+.3f} [{d[0]:+.3f}, {d[1]:+.3f}]"
            flips = f"{p['flips']['down']} / {p['flips']['up']}"
            rec = f"{p['recovery']:.3f}" if p.get("recovery") is not None else "-"
            lr = f"{p['length_ratio']:.3f}" if p.get("length_ratio") is not None else "-"
        else:
            diff, flips, rec, lr = "-", "-", "-", "1.000"
        spr = f"{r['seconds_per_record']:.1f}" if r["seconds_per_record"] else "(wall incomplete)"
        print(f"| {r['arm']} | {r['n']} | {r['score']:.3f} {ci(r['ci95'])} | {diff} | {flips} | {rec} | {lr} | "
              f"{r['tokens_per_step']:.2f} | {r['relaxed_per_token']:.4f} | {r['truncated']} "
              f"({r['truncated_share']:.1%}) | {spr} |")



# ---------------------------------------------------------------------------------- regime

def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def cmd_regime(args) -> int:
    """lab/scripts/bench_head_regime.sh's reports in OUTDIR as one table."""
    out = args.outdir
    rows, walls = [], []
    for t in ("0", "1"):
        for name in ("eagle3", "ngram"):
            path = os.path.join(out, f"{name}-t{t}.json")
            if not os.path.exists(path):
                continue
            rep = json.load(open(path, encoding="utf-8"))
            task = (rep.get("task") or {}).get("methods", {})
            for label, m in rep["methods"].items():
                tm = task.get(label, {})
                vs = tm.get("vs_baseline") or {}
                score = tm.get("mean")
                paired = "-"
                if vs and label != "strict":
                    lo, hi = vs["diff_ci95"]
                    paired = f"{vs['diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] ({vs['flips']['down']}/{vs['flips']['up']})"
                exact = m.get("exact_match_rate")
                rows.append(
                    f"| {'head' if name == 'eagle3' else 'ngram'}, {t} | {label} | {fmt(m['tokens_per_s'], '.1f')} | "
                    f"{fmt(m.get('speedup_vs_ar'), '.2f')} | {fmt(m.get('acceptance_length'), '.2f')} | "
                    f"{fmt(m.get('relaxed_share'), '.3f')} | {fmt(exact, '.2f')} | "
                    f"{fmt(m.get('nll_per_token'), '.3f')} | "
                    f"{fmt(score, '.3f')} | {paired} | "
                    f"{fmt(m.get('seconds_per_record'), '.1f')} |")
            log = os.path.join(out, f"{name}-t{t}.log")
            if os.path.exists(log):
                w = re.findall(r"^wall seconds: (\d+), exit code: (\d+)$", open(log, encoding="utf-8").read(), re.M)
                walls.append(f"{name} T={t}: " + ", ".join(f"{s} s (exit {c})" for s, c in w))
    print("| drafter, T | method | tok/s | x ar | tau | relaxed / token | same as ar | NLL / token | score "
          "| vs strict (down/up) | s / record |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("Walls (fit + bench): " + "; ".join(walls))
    return 0



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    r = sub.add_parser("ratios", help="per batch size, strict and MARS against ar, from one bench report")
    r.add_argument("report")
    m = sub.add_parser("merge", help="merge bench --task reports measured in chunks into one table")
    m.add_argument("reports", nargs="+")
    m.add_argument("--report", help="also write the merged figures as JSON here")
    m.add_argument("--quality-only", action="store_true",
                   help="merge task scores of chunks whose method lists or kernels differ; no speed figures")
    q = sub.add_parser("quality", help="generate arms scored and compared with the baseline arm")
    q.add_argument("outdir")
    q.add_argument("--arms", default="strict,mars,mars-code,ratio")
    q.add_argument("--baseline", default="strict")
    q.add_argument("--task", default="humaneval")
    q.add_argument("--prompts", help="the prompt set (gsm8k, sum: references)")
    q.add_argument("--python", default=sys.executable)
    g = sub.add_parser("regime", help="bench_head_regime.sh's reports, a row per drafter, temperature and method")
    g.add_argument("outdir")
    args = ap.parse_args(argv)
    return {"ratios": cmd_ratios, "merge": cmd_merge, "quality": cmd_quality, "regime": cmd_regime}[args.kind](args)


if __name__ == "__main__":
    sys.exit(main())
