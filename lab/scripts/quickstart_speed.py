#!/usr/bin/env python
"""`marscli generate` with no options against `--draft none`, on the README Quickstart's
prompts, in one process: is the default ever slower than plain decoding?

Both generators are loaded through the public API (the path `marscli generate` takes, with
its defaults: the embedded model, the ngram drafter, the matching shipped profile) and run
the same records in alternation, --rounds times, after one warm-up round each (the first
run also measures the step costs). Prints tokens/s of each and the ratio; outputs go to
stderr once so they can be compared by eye.

    python scripts/quickstart_speed.py                    # the Quickstart: 2 records, 48 tokens
    python scripts/quickstart_speed.py --rounds 10 --max-tokens 128
    python scripts/quickstart_speed.py --extra verify=strict
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QUICKSTART = [
    {"id": "q1", "messages": [{"role": "user", "content": "Name three planets of the solar system."}]},
    {"id": "q2", "prompt": "def fibonacci(n):"},
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--extra", action="append", default=[],
                   help="KEY=VALUE passed to marscli.load for the default side (e.g. verify=strict)")
    args = p.parse_args(argv)
    import marscli

    extra = dict(kv.split("=", 1) for kv in args.extra)
    default = marscli.load(**extra)
    plain = marscli.load(draft="none")
    print(f"default: drafter {default.generator.draft.kind}, verify {default.verify.mode}"
          f"{'' if default.verify.mode == 'strict' else f' theta {default.verify.theta:g}'}, "
          f"profile {default.profile.name if default.profile else None}", file=sys.stderr)
    sides = {"default": default, "draft none": plain}
    tokens = {k: 0 for k in sides}
    seconds = {k: 0.0 for k in sides}
    for rnd in range(args.rounds + 1):
        for name, llm in sides.items():
            t0 = time.perf_counter()
            res = llm.generate(QUICKSTART, max_tokens=args.max_tokens, timing=False)
            dt = time.perf_counter() - t0
            if rnd == 0:  # warm-up
                for r in res:
                    print(f"[{name}] {r['id']}: {r['output'][:70]!r} (tau {r['spec'].get('acceptance_length')})",
                          file=sys.stderr)
                continue
            tokens[name] += sum(r["usage"]["completion_tokens"] for r in res)
            seconds[name] += dt
    rate = {k: tokens[k] / seconds[k] for k in sides}
    for k in sides:
        print(f"{k:12s} {tokens[k]:6d} tokens {seconds[k]:8.2f} s {rate[k]:8.2f} tokens/s")
    print(f"default / draft none: {rate['default'] / rate['draft none']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
