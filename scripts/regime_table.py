#!/usr/bin/env python
"""The Markdown table of scripts/bench_head_regime.sh's reports: one row per drafter,
temperature and method with tokens/s, x ar, tau, the relaxed share of committed tokens, the
share of records identical to plain decoding's, the target's negative log-likelihood per
output token, the task score (ROUGE-L with TASK=sum) and its paired difference against strict, and seconds per
record; then each run's wall time from its log.

    python scripts/regime_table.py OUTDIR
"""

from __future__ import annotations

import json
import os
import re
import sys


def fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        raise SystemExit(__doc__)
    out = args[0]
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


if __name__ == "__main__":
    raise SystemExit(main())
