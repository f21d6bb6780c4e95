#!/usr/bin/env python
"""One target forward's cost by new tokens, with marscli's CPU fast path as it is and as it
was before oneDNN's packed weights (2026-11-25: dense products for 1-9 rows of the body and
1-32 of the head, one row padded to two, contiguous outputs; F.linear beyond), interleaved in random order so that
the machine's drifting memory bandwidth spoils both alike. Prints ms per forward (the
fastest and the 25th percentile of ROUNDS rounds) and the ratio now/before.

    python scripts/fastpath_costs.py [--rounds 12] [--context 256] [--tokens 1,2,3,4,5,6,9]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch import nn

from marscli.config import ModelConfig
from marscli.models.fastpath import _PACKED, BODY_ROWS, HEAD_ROWS, install_cpu_fastpath
from marscli.models.kvcache import cache_kw, new_cache, rollback
from marscli.models.loading import load_model


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=None)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--tokens", default="1,2,3,4,5,6,9")
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]

    m = load_model(ModelConfig(source=args.target)).model.eval()
    install_cpu_fastpath(m)
    mode = {"old": False}
    for mod in m.modules():
        if type(mod) is not nn.Linear:
            continue
        now = mod.forward  # the patched forward

        def old(x, mod=mod, now=now):  # the same patched forward, its packed copy hidden
            packed = getattr(mod, _PACKED, None)
            setattr(mod, _PACKED, None)
            try:
                return now(x)
            finally:
                setattr(mod, _PACKED, packed)

        mod.forward = lambda x, now=now, old=old: old(x) if mode["old"] else now(x)

    gen = torch.Generator().manual_seed(0)
    vocab = m.get_input_embeddings().weight.shape[0]
    cache = new_cache(m)
    times: dict[tuple[int, bool], list[float]] = {}
    with torch.inference_mode():
        m(input_ids=torch.randint(0, vocab, (1, args.context), generator=gen), **cache_kw(m, cache),
          use_cache=True, logits_to_keep=1)
        shapes = [(n, o) for n in tokens for o in (False, True)]
        for rnd in range(args.rounds + 1):  # the first round warms up
            random.Random(rnd).shuffle(shapes)
            for n, o in shapes:
                mode["old"] = o
                x = torch.randint(0, vocab, (1, n), generator=gen)
                t0 = time.perf_counter()
                m(input_ids=x, **cache_kw(m, cache), use_cache=True)
                dt = time.perf_counter() - t0
                rollback(cache, args.context)
                if rnd:
                    times.setdefault((n, o), []).append(dt)
    q = max(0, args.rounds // 4 - 1)
    print(f"ms per forward at {args.context} cached tokens, {args.rounds} rounds "
          f"(fastest / 25th percentile); body rows now {BODY_ROWS}, head rows {HEAD_ROWS}")
    print("new tokens | before min | before q25 | now min | now q25 | now/before (min)")
    for n in tokens:
        b, a = sorted(times[(n, True)]), sorted(times[(n, False)])
        print(f"{n:10d} | {b[0] * 1e3:10.1f} | {b[q] * 1e3:10.1f} | {a[0] * 1e3:7.1f} | {a[q] * 1e3:7.1f} "
              f"| {a[0] / b[0]:.2f}")


if __name__ == "__main__":
    main()
