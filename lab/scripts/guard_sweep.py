"""Sweep the loop guard's settings on real prompts: what each setting does to acceptance and to
repetition (issue 17; docs/calibration.md, "Loops").

Every figure printed is a count over the generated tokens (tau, relaxed share, repetition,
loops, refusals), so it does not depend on machine load; time the chosen settings with
`marscli bench` on an idle machine.

    python scripts/guard_sweep.py --prompts ../shared/data/prompts/humaneval.jsonl --limit 20 \
        --max-tokens 128 --theta 0.9405 --configs none,n3,n4,n6,n4+b0.25,b0.25 --out sweep.json

A config is `none` (the paper's rule), `strict`, or `+`-joined parts: `nN` (n-gram size N),
`wW` (window W tokens), `bS` (max relaxed share S).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from marscli.bench.metrics import common_prefix_len
from marscli.config import DEFAULT_GUARD_WINDOW


def parse_config(name: str) -> dict:
    if name == "strict":
        return {"verify": "strict"}
    if name == "none":
        return {"verify": "mars", "no_guard": True}
    kw = {"verify": "mars", "repeat_guard": 0, "repeat_window": DEFAULT_GUARD_WINDOW, "max_relaxed_share": 1.0}
    for part in name.split("+"):
        key, val = part[0], part[1:]
        if key == "n":
            kw["repeat_guard"] = int(val)
        elif key == "w":
            kw["repeat_window"] = int(val)
        elif key == "b":
            kw["max_relaxed_share"] = float(val)
        else:
            raise SystemExit(f"unknown config part {part!r} in {name!r}")
    return kw


def records(path: str, limit: int) -> list[dict]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append({"id": str(r.get("question_id", len(out))),
                        "messages": [{"role": "user", "content": r["turns"][0]}]})
            if len(out) == limit:
                break
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", action="append", required=True, help="prompt-set JSONL (repeatable)")
    ap.add_argument("--limit", type=int, default=20, help="records per prompt set")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--theta", type=float, required=True)
    ap.add_argument("--target", default=None)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--configs", default="strict,none,n3,n4,n6,n4+b0.25,b0.25")
    ap.add_argument("--out", default=None, help="write every config's figures as JSON here")
    args = ap.parse_args()

    import marscli

    recs = [r for p in args.prompts for r in records(p, args.limit)]
    names = args.configs.split(",")
    if "strict" not in names:
        names = ["strict", *names]
    rows, outputs = {}, {}
    for name in names:
        kw = parse_config(name)
        llm = marscli.load(args.target, "ngram", theta=None if kw["verify"] == "strict" else args.theta,
                           batch_size=args.batch_size, **kw)
        t0 = time.perf_counter()
        res = llm.generate(recs, max_tokens=args.max_tokens, token_ids=True, timing=False)
        wall = time.perf_counter() - t0
        toks = sum(len(r["token_ids"]) for r in res)
        steps = sum(r["spec"]["steps"] for r in res)
        outputs[name] = [r["token_ids"] for r in res]
        rows[name] = {
            "tokens": toks, "tau": toks / steps,
            "relaxed_share": sum(r["spec"]["relaxed"] for r in res) / toks,
            "repeat_share": sum(r["spec"]["repeat_share"] for r in res) / len(res),
            "loops": sum(r["spec"]["ends_in_loop"] for r in res),
            "refused": sum(r["spec"].get("guard_refused", 0) for r in res),
            "budget_spent": sum(r["spec"].get("budget_spent_at") is not None for r in res),
            "wall_s_loaded": round(wall, 1),
        }
        print(f"{name}: {rows[name]}", file=sys.stderr, flush=True)
    ref = outputs["strict"]
    for name in names:
        out = outputs[name]
        rows[name]["same_as_strict"] = sum(a == b for a, b in zip(out, ref))
        rows[name]["prefix_share"] = sum(common_prefix_len(a, b) / max(len(b), 1) for a, b in zip(out, ref)) / len(ref)
    hdr = ("config", "tau", "tau/strict", "relaxed", "repeat", "loops", "refused", "budget", "same", "prefix")
    print(f"{len(recs)} records, {args.max_tokens} tokens, theta {args.theta}")
    print(" | ".join(hdr))
    t_strict = rows["strict"]["tau"]
    for name in names:
        r = rows[name]
        print(" | ".join([name, f"{r['tau']:.3f}", f"{r['tau'] / t_strict:.3f}", f"{r['relaxed_share']:.3f}",
                          f"{r['repeat_share']:.3f}", f"{r['loops']}/{len(recs)}", str(r["refused"]),
                          str(r["budget_spent"]), f"{r['same_as_strict']}/{len(recs)}", f"{r['prefix_share']:.2f}"]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"records": len(recs), "max_tokens": args.max_tokens, "theta": args.theta,
                       "configs": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
