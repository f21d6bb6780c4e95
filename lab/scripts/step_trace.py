#!/usr/bin/env python
"""Where a batched speculative run spends its steps: per batch size, every decoding step's
rows B, longest draft L, wall seconds, tokens emitted, and what the draft-length policy
predicted (the measured t(B, n) it chose by, and each drafting row's expected tokens).

It answers "why is strict slower than ar at batch 16": are drafting steps worth what they
cost (predicted vs actual seconds and tokens), and what does the speculative loop itself
cost per step when nothing is drafted (L = 0 steps of strict against ar's steps).

    python scripts/step_trace.py --batch-sizes 16 --per-file 4 --max-tokens 64
    python scripts/step_trace.py --batch-sizes 1,16 --json /tmp/trace.json

Measure on an idle machine: one process, the drafters in turn (none = ar, then ngram).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_batch import DEFAULT_PROMPTS, load_records  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="16")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS))
    p.add_argument("--per-file", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=8)
    p.add_argument("--drafters", default="none,ngram")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def trace(engine, prompts, max_tokens):
    """Run every prompt; return one dict per decoding step."""
    from marscli.config import SamplingParams

    steps = []
    chosen = {}
    offered = {}
    draft_lengths = engine.draft_lengths
    offers_of = engine.drafters.offers

    def spy_offers(seqs, caps):
        out = offers_of(seqs, caps)
        offered["o"] = out
        return out

    def spy_lengths(offers, caps):
        ks = draft_lengths(offers, caps)
        chosen["ks"] = ks
        return ks

    engine.drafters.offers = spy_offers
    engine.draft_lengths = spy_lengths
    step = engine._step

    def timed_step():
        rows = list(engine.rows)
        before = sum(r.seq.stats.emitted for r in rows)
        chosen.clear()
        offered.clear()
        t0 = time.perf_counter()
        finished = step()
        dt = time.perf_counter() - t0
        ks = chosen.get("ks", [0] * len(rows))
        offers = offered.get("o", [])
        from marscli.drafters.base import expected_tokens

        B, L = len(rows), max(ks, default=0)
        steps.append({
            "B": B, "L": L, "seconds": dt,
            "emitted": sum(r.seq.stats.emitted for r in rows) - before,
            "expected": sum(expected_tokens(o.alpha, k) for o, k in zip(offers, ks)) if offers else B,
            "predicted_s": engine.costs.step(B, L),
            "drafting_rows": sum(1 for k in ks if k > 0),
            "offering_rows": sum(1 for o in offers if o.available > 0),
            "cache_len": int(engine.kv.mask.shape[1]),
        })
        return finished

    engine._step = timed_step
    sampling = SamplingParams(max_tokens=max_tokens)
    t0 = time.perf_counter()
    out = {i: res for i, res in engine.run(range(len(prompts)), lambda i: (prompts[i], sampling))}
    wall = time.perf_counter() - t0
    engine._step = step
    tokens = {i: list(r.token_ids) for i, r in out.items()}
    return steps, wall, tokens


def summarize(name, B, steps, wall, n_tokens):
    decode = sum(s["seconds"] for s in steps)
    print(f"\n{name} at batch {B}: {len(steps)} steps, {n_tokens} tokens, {wall:.1f} s "
          f"({n_tokens / wall:.1f} tokens/s; decoding steps {decode:.1f} s, the rest prefill/refill)")
    by = defaultdict(list)
    for s in steps:
        by[(s["B"], s["L"])].append(s)
    print("  rows  L  steps  sec/step  predicted  tokens/step  expected  tokens/s(step)")
    for (b, L), ss in sorted(by.items()):
        n = len(ss)
        sec = sum(s["seconds"] for s in ss) / n
        pred = sum(s["predicted_s"] for s in ss) / n
        em = sum(s["emitted"] for s in ss) / n
        ex = sum(s["expected"] for s in ss) / n
        print(f"  {b:4d} {L:2d} {n:6d} {sec * 1000:8.1f}ms {pred * 1000:8.1f}ms {em:11.2f} {ex:9.2f} {em / sec:10.1f}")


def main(argv=None):
    args = parse_args(argv)
    from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
    from marscli.engine import build_engine
    from marscli.jobs.setup import load_models

    target, _ = load_models(ModelConfig(), None)
    records = load_records(args.prompts, args.per_file)
    report = {}
    tokens_of = {}
    for B in [int(x) for x in args.batch_sizes.split(",")]:
        for kind in args.drafters.split(","):
            dcfg = DraftConfig(kind=kind, num_draft_tokens=args.num_draft_tokens)
            engine = build_engine(target, None, VerifyConfig(), dcfg, B)
            enc = engine.prompts
            prompts = [enc.fit_prompt(enc.tokenize(it), truncate="left", max_tokens=args.max_tokens)[0]
                       for it in records]
            list(engine.run([0], lambda i, p=prompts: (p[i][-64:], SamplingParams(max_tokens=8))))  # warm-up
            steps, wall, tokens = trace(engine, prompts, args.max_tokens)
            n = sum(len(t) for t in tokens.values())
            summarize("ar" if kind == "none" else f"strict ({kind})", B, steps, wall, n)
            if tokens_of.get(B) is not None and tokens_of[B] != tokens:
                print(f"  outputs differ from the first drafter's at batch {B}", file=sys.stderr)
            tokens_of.setdefault(B, tokens)
            report[f"{kind}@{B}"] = {"wall": wall, "tokens": n, "steps": steps}
    if args.json:
        Path(args.json).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
