"""Speed of marscli generate vs transformers generate() on the embedded model, one process.

Methods run interleaved per prompt (so machine drift hits all alike), greedy, same max
tokens. Prints a table of tokens/s, ratios and exactness against hf-generate. The full
`marscli bench` command (issue 5) will supersede this script.

    python scripts/bench_generate.py --sets sum,humaneval --n 10 --max-tokens 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from marscli.config import DraftConfig, ModelConfig, Request, SamplingParams, VerifyConfig
from marscli.engine import SpecEngine, build_drafter
from marscli.models import load_model

PROMPTS = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sets", default="sum,humaneval")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--theta", type=float, default=0.9)
    ap.add_argument("--pld-tokens", type=int, default=10, help="transformers prompt_lookup_num_tokens")
    args = ap.parse_args()

    t = time.perf_counter()
    target = load_model(ModelConfig(device="cpu", dtype="float32"))
    print(f"load (warm cache): {time.perf_counter() - t:.2f} s", file=sys.stderr)
    model, tok = target.model, target.tokenizer

    def engine(kind, verify):
        cfg = DraftConfig(kind=kind, num_draft_tokens=8)
        return SpecEngine(target, build_drafter(cfg, target), verify, cfg)

    ours = {
        "marscli-ar": engine("none", VerifyConfig()),
        "marscli-ngram-strict": engine("ngram", VerifyConfig()),
        f"marscli-ngram-mars{args.theta:g}": engine("ngram", VerifyConfig("mars", args.theta)),
    }

    def hf(ids, **kw):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=args.max_tokens, **kw)
        return out[0, len(ids):].tolist()

    methods = {
        "hf-generate": lambda ids: (hf(ids), None),
        f"hf-prompt-lookup{args.pld_tokens}": lambda ids: (hf(ids, prompt_lookup_num_tokens=args.pld_tokens), None),
    }
    for name, eng in ours.items():
        methods[name] = (lambda e: lambda ids: (lambda r: (r.token_ids, r.stats))(
            e.generate_ids(ids, SamplingParams(max_tokens=args.max_tokens))))(eng)

    for set_name in args.sets.split(","):
        with (PROMPTS / f"{set_name}.jsonl").open() as f:
            recs = [json.loads(line) for _, line in zip(range(args.n), f)]
        agg = {m: {"tokens": 0, "seconds": 0.0, "exact": 0, "steps": 0, "relaxed": 0} for m in methods}
        with torch.inference_mode():
            warm = engine("none", VerifyConfig()).encode(Request(0, 1, "w", messages=[{"role": "user", "content": "hi"}]))
            for fn in methods.values():
                fn(warm)
            for rec in recs:
                ids = ours["marscli-ar"].encode(
                    Request(0, 1, "x", messages=[{"role": "user", "content": rec["turns"][0]}]))
                ref = None
                for m, fn in methods.items():
                    t0 = time.perf_counter()
                    toks, stats = fn(ids)
                    dt = time.perf_counter() - t0
                    if ref is None:
                        ref = toks
                    a = agg[m]
                    a["tokens"] += len(toks)
                    a["seconds"] += dt
                    a["exact"] += int(toks == ref)
                    if stats is not None:
                        a["steps"] += stats.steps
                        a["relaxed"] += stats.relaxed
        base = agg["hf-generate"]["tokens"] / agg["hf-generate"]["seconds"]
        pld = agg[f"hf-prompt-lookup{args.pld_tokens}"]
        pld_tps = pld["tokens"] / pld["seconds"]
        print(f"\n{set_name}: {len(recs)} prompts, max {args.max_tokens} new tokens, greedy, CPU float32")
        print(f"{'method':28} {'tok/s':>7} {'x hf-gen':>8} {'x hf-pld':>8} {'exact':>6} {'tau':>5} {'relaxed':>7}")
        for m, a in agg.items():
            tps = a["tokens"] / a["seconds"]
            tau = f"{a['tokens'] / a['steps']:.2f}" if a["steps"] else "-"
            rel = f"{a['relaxed'] / a['tokens']:.3f}" if a["steps"] else "-"
            print(f"{m:28} {tps:7.2f} {tps / base:8.2f} {tps / pld_tps:8.2f} {a['exact']:>3}/{len(recs):<2} {tau:>5} {rel:>7}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
