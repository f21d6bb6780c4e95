#!/usr/bin/env python
"""The ratios a `marscli bench --batch-size ...` report is read for: per batch size strict
and MARS against ar (plain decoding through marscli), and at batch size 1 strict against
transformers' prompt-lookup generation (hf-assisted with the ngram drafter), plus whether
strict's outputs equal ar's at every batch size.

    marscli bench prompts.jsonl --methods hf-generate,hf-assisted,ar,strict,mars \\
        --batch-size 1,4,8,16 --max-tokens 64 --report bench.json
    python scripts/bench_ratios.py bench.json
"""

from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    report = json.load(open(argv[0]))
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


if __name__ == "__main__":
    raise SystemExit(main())
