#!/usr/bin/env python
"""The quality table of a set of generate runs over the same prompts (one results file per
arm, e.g. scripts/quality_qwen_humaneval.sh's OUTDIR): every arm scored with `marscli score`
and compared with the baseline arm paired by record (pass@1 or accuracy with its 95% CI, the
paired difference with its bootstrap CI, flips both ways, recovery, length ratio), beside each
arm's decoding figures from its result lines (tokens per step, relaxed drafts per token,
truncated share) and its throughput from the wall times its log recorded.

    python scripts/quality_table.py quality-qwen --task humaneval --arms strict,mars,mars-code,ratio

Each arm ARM is OUTDIR/ARM.jsonl (and OUTDIR/ARM.log, whose "wall seconds: S, exit code: C"
lines are summed: a run killed before that line leaves its wall time out, and the table says
so; "paused seconds: P" lines, written when a run was stopped with SIGSTOP so that the machine
could do something else, are subtracted). Writes OUTDIR/ARM.scored.jsonl and
OUTDIR/ARM.summary.json, prints the Markdown table (stdout) and writes OUTDIR/table.json.
Only records present in every arm are compared, so a table can be read while arms are still
running.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--arms", default="strict,mars,mars-code,ratio")
    ap.add_argument("--baseline", default="strict")
    ap.add_argument("--task", default="humaneval")
    ap.add_argument("--prompts", help="the prompt set (gsm8k, sum: references)")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)

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


if __name__ == "__main__":
    sys.exit(main())
