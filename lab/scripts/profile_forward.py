#!/usr/bin/env python
"""Where one target forward's time goes, float32 against `--quant int8` (issue 35).

Loads the model as `generate` does (CPU fast path for float32; int8 weights and float64
attention for int8), fills a KV cache with CONTEXT random tokens, then times forwards over
each count of new tokens (fastest and median of ROUNDS) and profiles one with
torch.profiler: the number of torch ops per forward, and self time by op, with the int8
layers' own work (fbgemm's product, and the row quantization around it) split out.

    python scripts/profile_forward.py [--target NAME] [--context 256] [--tokens 1,9]
        [--rounds 20] [--top 15]
    python scripts/profile_forward.py --ab-decoder [--target NAME] ...

--ab-decoder times int8 forwards only, alternating round by round between the TorchScript
decoder layers (marscli.models.int8_decoder, what `--quant int8` runs) and transformers' own
layers on the same model object, and checks that both give the same logits bit for bit.

Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from marscli.config import ModelConfig
from marscli.models.kvcache import cache_kw, new_cache, rollback
from marscli.models.loading import load_model

PRODUCT = "quantized::linear_with_input_q_dq_qweight_dq_output_fp32"


def _prefilled(quant: str | None, args):
    """The model loaded as `generate` loads it, a seeded generator, its vocabulary size, and a
    KV cache holding args.context random tokens."""
    lm = load_model(ModelConfig(source=args.target, dtype="float32", device="cpu", quant=quant))
    m = lm.model.eval()
    gen = torch.Generator().manual_seed(0)
    vocab = m.get_input_embeddings().weight.shape[0]
    cache = new_cache(m)
    with torch.inference_mode():
        m(input_ids=torch.randint(0, vocab, (1, args.context), generator=gen), **cache_kw(m, cache),
          use_cache=True, logits_to_keep=1)
    return m, gen, vocab, cache


def run(quant: str | None, args) -> None:
    m, gen, vocab, cache = _prefilled(quant, args)
    label = quant or "float32"
    with torch.inference_mode():
        for n in args.tokens:
            times = []
            for r in range(args.rounds + 2):
                x = torch.randint(0, vocab, (1, n), generator=gen)
                t0 = time.perf_counter()
                m(input_ids=x, **cache_kw(m, cache), use_cache=True)
                if r >= 2:
                    times.append(time.perf_counter() - t0)
                rollback(cache, args.context)
            print(f"{label}: {n} new token(s) at {args.context} cached: fastest {min(times) * 1e3:.1f} ms, "
                  f"median {statistics.median(times) * 1e3:.1f} ms ({args.rounds} rounds)")
            x = torch.randint(0, vocab, (1, n), generator=gen)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                m(input_ids=x, **cache_kw(m, cache), use_cache=True)
            rollback(cache, args.context)
            top = [e for e in prof.events() if "::" in e.name and e.cpu_parent is None]
            self_us = Counter()
            count = Counter()
            for e in prof.events():
                self_us[e.name] += e.self_cpu_time_total
                count[e.name] += 1
            total = sum(e.cpu_time_total for e in top)
            product = self_us.get(PRODUCT, 0)
            print(f"  profiled: {len(top)} top-level torch ops, {sum(count.values())} events, "
                  f"{total / 1e3:.1f} ms inside them (profiler on); int8 products {product / 1e3:.1f} ms "
                  f"({count.get(PRODUCT, 0)} calls)")
            for name, us in self_us.most_common(args.top):
                print(f"    {name:60s} {count[name]:6d} calls {us / 1e3:8.2f} ms self")


def ab_decoder(args) -> None:
    """Interleaved rounds: int8 decoder layers in TorchScript against transformers' layers."""
    from marscli.models.int8_decoder import install_int8_decoder, uninstall_int8_decoder

    m, gen, vocab, cache = _prefilled("int8", args)
    with torch.inference_mode():
        for n in args.tokens:
            x = torch.randint(0, vocab, (1, n), generator=gen)
            times, logits = {"torchscript": [], "transformers": []}, {}
            for r in range(args.rounds + 2):
                for arm in times:
                    (install_int8_decoder if arm == "torchscript" else uninstall_int8_decoder)(m)
                    t0 = time.perf_counter()
                    logits[arm] = m(input_ids=x, **cache_kw(m, cache), use_cache=True).logits
                    if r >= 2:
                        times[arm].append(time.perf_counter() - t0)
                    rollback(cache, args.context)
            install_int8_decoder(m)
            same = torch.equal(logits["torchscript"], logits["transformers"])
            fast, slow = (min(times[a]) for a in ("torchscript", "transformers"))
            print(f"int8, {n} new token(s) at {args.context} cached, {args.rounds} alternating rounds: "
                  + ", ".join(f"{a} fastest {min(v) * 1e3:.1f} / median {statistics.median(v) * 1e3:.1f} ms"
                              for a, v in times.items())
                  + f"; transformers / torchscript {slow / fast:.2f}x (fastest); logits equal: {same}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=None, help="default: the embedded model")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,9")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--modes", default="float32,int8")
    ap.add_argument("--ab-decoder", action="store_true",
                    help="int8 only: TorchScript decoder layers against transformers' own, alternating")
    args = ap.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    if args.ab_decoder:
        ab_decoder(args)
        return
    for mode in args.modes.split(","):
        run(None if mode == "float32" else mode, args)


if __name__ == "__main__":
    main()
