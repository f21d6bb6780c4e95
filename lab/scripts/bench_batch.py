#!/usr/bin/env python
"""Tokens/s of batched speculative decoding for several batch sizes, in one run.

Each batch size runs in a fresh child process (so its peak RSS is its own) on the same
prompts with the same settings; the parent checks that every batch size produced the same
tokens and prints one table. Default: the embedded model, the ngram drafter, strict greedy
verification, the first --per-file prompts of each file in ../shared/data/prompts.

    python scripts/bench_batch.py                       # batch sizes 1,4,8,16
    python scripts/bench_batch.py --batch-sizes 1,8 --per-file 2 --max-tokens 48
    python scripts/bench_batch.py --target ./SmolLM2-360M --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PROMPTS = ROOT.parent / "shared" / "data" / "prompts"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", default="1,4,8,16")
    p.add_argument("--prompts", default=str(DEFAULT_PROMPTS), help="a JSONL file or a folder of them")
    p.add_argument("--per-file", type=int, default=4, help="prompts taken from each file")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--target", default=None, help="model (default: the embedded one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def load_records(source: str, per_file: int):
    from marscli.config import RecordError
    from marscli.io.input_index import read_input

    path = Path(source)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    records = []
    for f in files:
        items, _ = read_input(str(f), limit=per_file)
        records += [it for it in items if not isinstance(it, RecordError)]
    return records


def run_one(args) -> dict:
    import torch

    from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
    from marscli.engine import build_engine
    from marscli.jobs.bench import batch_counters
    from marscli.jobs.setup import load_models

    target, _ = load_models(ModelConfig(source=args.target, device=args.device, dtype=args.dtype), None)
    dcfg = DraftConfig(kind="ngram", num_draft_tokens=args.num_draft_tokens)
    engine = build_engine(target, None, VerifyConfig(), dcfg, args.one)
    records = load_records(args.prompts, args.per_file)
    sampling = SamplingParams(max_tokens=args.max_tokens)
    # Keyed by position: a record's index is its line in its own file, so records of
    # different files share indices.
    prompts = [engine.prompts.fit_prompt(engine.prompts.tokenize(it), truncate="left", max_tokens=args.max_tokens)[0]
               for it in records]
    # Warm up kernels and allocator outside the timed run.
    list(engine.run([0], lambda i: (prompts[i][-64:], SamplingParams(max_tokens=8))))
    # The timed run's counters only (an engine without batch counters reports none).
    for attr, zero in (("peak_cache_bytes", 0), ("prefill_seconds", 0.0)):
        if hasattr(engine, attr):
            setattr(engine, attr, zero)
    if target.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    tokens = 0
    steps = 0
    outputs = {}
    for i, res in engine.run(range(len(records)), lambda i: (prompts[i], sampling)):
        if isinstance(res, BaseException):
            raise res
        tokens += res.completion_tokens
        steps += res.stats.steps
        outputs[i] = res.token_ids
    if target.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    counters = batch_counters(engine)
    prefill = counters["prefill_seconds"] or 0.0
    digest = hashlib.sha256(json.dumps([outputs[i] for i in sorted(outputs)]).encode()).hexdigest()[:12]
    out = {
        "batch_size": args.one,
        "records": len(records),
        "prompt_tokens": sum(len(p) for p in prompts),
        "distinct_prompts": len({tuple(p) for p in prompts}),
        "tokens": tokens,
        "seconds": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 2),
        "prefill_seconds": round(prefill, 2),
        "decode_tokens_per_s": round(tokens / max(seconds - prefill, 1e-9), 2),
        "acceptance_length": round(tokens / max(steps, 1), 3),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "peak_kv_cache_mib": round(counters["peak_kv_cache_mib"] or 0.0, 1),
        "oom_halvings": counters["oom_halvings"] or 0,
        "outputs_sha256": digest,
        "device": str(target.device),
    }
    if target.device.type == "cuda":
        out["peak_cuda_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.one is not None:
        print(json.dumps(run_one(args)), flush=True)
        return 0
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    rows = []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for bs in sizes:
        cmd = [sys.executable, __file__, "--one", str(bs)] + [
            a for a in (argv if argv is not None else sys.argv[1:])]
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if r.returncode != 0:
            print(f"batch size {bs} failed (exit {r.returncode})", file=sys.stderr)
            return 1
        row = json.loads(r.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(f"batch {bs}: {row['tokens_per_s']} tok/s", file=sys.stderr, flush=True)
    base = rows[0]["tokens_per_s"]
    print(f"{rows[0]['records']} records ({rows[0]['distinct_prompts']} distinct, "
          f"{rows[0]['prompt_tokens']} prompt tokens), "
          f"max {args.max_tokens} new tokens, ngram K<={args.num_draft_tokens}, strict greedy, "
          f"{rows[0]['device']}, {args.dtype}\n")
    dbase = rows[0]["decode_tokens_per_s"]
    print("| batch | tokens | seconds | of which prefill | tokens/s | vs batch " f"{sizes[0]} | "
          "decode tokens/s | vs batch " f"{sizes[0]} | tau | peak RSS MiB | peak KV MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['tokens']} | {r['seconds']} | {r['prefill_seconds']} | "
              f"{r['tokens_per_s']} | {r['tokens_per_s'] / base:.2f}x | {r['decode_tokens_per_s']} | "
              f"{r['decode_tokens_per_s'] / dbase:.2f}x | {r['acceptance_length']} | {r['peak_rss_mib']} | "
              f"{r['peak_kv_cache_mib']} |")
    same = len({r["outputs_sha256"] for r in rows}) == 1
    print(f"\nidentical outputs across batch sizes: {'yes' if same else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if same else 2


if __name__ == "__main__":
    sys.exit(main())
