#!/usr/bin/env python
"""The cost of logprobs and of n samples per request (issue 18's closing note), in one run.

On the same prompts, in one process, interleaved over --repeats rounds (the median round
is reported), through the public API (marscli.load(...).generate, the path the CLI takes):

- base:       every prompt once (n = 1), no logprobs;
- logprobs:   the same with logprobs and --top-logprobs alternatives per token;
- n=N:        every prompt once with n = N (the choices share one prefill);
- N separate: every prompt N times as separate records with seeds seed .. seed+N-1 (exactly
              the n = N choices, each prefilled on its own).

It checks that logprobs change no token and that the n = N choices equal the N separate
records, then prints tokens/s per method and the ratios logprobs/base and n=N/N separate.
Default: the embedded model, the ngram drafter, strict verification, temperature 0.8, the
first --per-file prompts of each file in ../shared/data/prompts.

    python scripts/bench_openai.py                                   # the closing note's run
    python scripts/bench_openai.py --per-file 1 --max-tokens 8 --repeats 1   # a quick check
    python scripts/bench_openai.py --batch-size 8 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT.parent / "shared" / "data" / "prompts"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="a JSONL file or a folder of them")
    p.add_argument("--per-file", type=int, default=4, help="prompts taken from each file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n", type=int, default=4, help="samples per request")
    p.add_argument("--top-logprobs", type=int, default=5)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds; the median counts")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--draft", default="ngram")
    p.add_argument("--target", default=None, help="model (default: the embedded one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args(argv)


def load_records(source: str, per_file: int) -> list[dict]:
    """The first per_file lines of each JSONL file, as raw records (ids made unique)."""
    path = Path(source)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    out = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for i, line in zip(range(per_file), fh):
                rec = json.loads(line)
                for key in ("id", "custom_id", "question_id", "n", "logprobs", "top_logprobs", "seed"):
                    rec.pop(key, None)
                rec["id"] = f"{f.stem}-{i}"
                out.append(rec)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    import marscli

    llm = marscli.load(args.target, args.draft, verify="strict", batch_size=args.batch_size,
                       device=args.device, dtype=args.dtype, auto_profile=False)
    records = load_records(args.prompts, args.per_file)
    n = args.n
    separate = [{**r, "id": f"{r['id']}#{i}", "seed": args.seed + i} for r in records for i in range(n)]
    common = dict(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, timing=False,
                  truncate_prompt="left")
    methods = {
        "base": (records, {}),
        "logprobs": (records, {"top_logprobs": args.top_logprobs}),
        f"n={n}": (records, {"n": n}),
        f"{n} separate": (separate, {}),
    }
    llm.generate(records[:1], max_tokens=8, timing=False)  # warm-up outside the timed runs
    rates: dict[str, list[float]] = {m: [] for m in methods}
    outputs: dict[str, list] = {}
    for _ in range(args.repeats):
        for name, (recs, extra) in methods.items():
            t0 = time.perf_counter()
            res = llm.generate(recs, **common, **extra)
            seconds = time.perf_counter() - t0
            bad = [r for r in res if r["error"]]
            if bad:
                print(f"{name}: {len(bad)} failed records, e.g. {bad[0]['error']}", file=sys.stderr)
                return 1
            tokens = sum(r["usage"]["completion_tokens"] for r in res)
            rates[name].append(tokens / seconds)
            outputs[name] = res
    # The comparisons are fair only if the work is the same.
    same_lp = [r["output"] for r in outputs["base"]] == [r["output"] for r in outputs["logprobs"]]
    n_outs = [c["output"] for r in outputs[f"n={n}"] for c in (r.get("choices") or [r])]
    same_n = n_outs == [r["output"] for r in outputs[f"{n} separate"]]
    med = {m: statistics.median(v) for m, v in rates.items()}
    print(f"{len(records)} prompts, max_tokens {args.max_tokens}, temperature {args.temperature}, "
          f"drafter {args.draft}, batch size {args.batch_size}, {args.repeats} interleaved round(s), "
          f"median tokens/s:")
    for m, v in med.items():
        print(f"  {m:>14}: {v:8.2f} tok/s   (rounds: {', '.join(f'{x:.2f}' for x in rates[m])})")
    ratio_lp = med["logprobs"] / med["base"]
    ratio_n = med[f"n={n}"] / med[f"{n} separate"]
    print(f"logprobs / base (top {args.top_logprobs}): {ratio_lp:.3f}   same tokens: {same_lp}")
    print(f"n={n} / {n} separate requests: {ratio_n:.3f}   same outputs: {same_n}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "tokens_per_s": rates, "median": med,
                                               "logprobs_ratio": ratio_lp, "n_ratio": ratio_n,
                                               "same_tokens_with_logprobs": same_lp,
                                               "n_equals_separate": same_n}, indent=2))
    return 0 if same_lp and same_n else 1


if __name__ == "__main__":
    sys.exit(main())
