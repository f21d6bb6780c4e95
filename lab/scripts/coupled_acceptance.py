"""Acceptance of a sampling drafter's draft: rejection sampling against coupled draws (issue 60).

Since issue 60 a sampled position's token is a Gumbel-max draw with noise from the record's
seed and the position (marscli.verification.draws), and a drafter that samples draws with the
same noise; a draft is kept when it equals the target's draw. Before, a draft x ~ q was kept
with probability min(1, p(x) / q(x)) (rejection sampling). Per position, with the target's
distribution p and the drafter's q at temperature 1:

- rejection sampling keeps the draft with probability sum_x min(p_x, q_x) = 1 - TV(p, q);
- the coupled draws agree with probability sum_x 1 / sum_y max(p_y / p_x, q_y / q_x)
  (the exponential-race form of Gumbel-max: x wins under both laws iff E_y > E_x * max(p_y /
  p_x, q_y / q_x) for every y; integrate over E_x ~ Exp(1)). It is computed exactly over the
  K candidates with the largest min(p_x, q_x); the rest add at most their sum of min(p_x, q_x)
  and the y past the 1,024 likeliest of each law are bounded (the upper bound printed beside it).

The positions are the target's own temperature-1 texts (teacher forced: one forward of each
model over prompt + output, the output re-tokenized from its text). An n-gram drafter's draft
is a point mass: both schemes keep it with probability p(x), so it needs no measurement.

    python lab/scripts/coupled_acceptance.py docs/results/qwen-pair/t1-humaneval/strict.jsonl \
        /work/shared/data/prompts/humaneval.jsonl --target qwen2.5-coder-1.5b-instruct \
        --draft qwen2.5-coder-0.5b-instruct --limit 40 [--quant int8] --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from marscli.config import ModelConfig
from marscli.engine.prompts import PromptEncoder
from marscli.io.records import read_requests
from marscli.jobs.setup import load_models


def coupled_agreement(p: torch.Tensor, q: torch.Tensor, k: int = 32, top: int = 1024
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of p, q ([N, V], each a distribution): a lower and an upper bound on the
    coupled draws' agreement. Candidates x: the k largest min(p_x, q_x) (the others add at most
    their min(p_x, q_x) to the upper bound); the sum over y is exact over the `top` largest
    p_y and q_y, and the remaining mass R adds between max(P_R / p_x, Q_R / q_x) and
    P_R / p_x + Q_R / q_x to it."""
    m = torch.minimum(p, q)
    cand = m.topk(min(k, p.shape[-1]), dim=-1).indices  # [N, k]
    ys = torch.cat([p.topk(min(top, p.shape[-1]), -1).indices, q.topk(min(top, q.shape[-1]), -1).indices], -1)
    ys = torch.sort(ys, -1).values
    dup = torch.zeros_like(ys, dtype=torch.bool)
    dup[:, 1:] = ys[:, 1:] == ys[:, :-1]
    pT = p.gather(-1, ys).masked_fill(dup, 0.0).double()  # [N, T], each y once
    qT = q.gather(-1, ys).masked_fill(dup, 0.0).double()
    pR = (1.0 - pT.sum(-1)).clamp(min=0)[:, None]  # [N, 1]
    qR = (1.0 - qT.sum(-1)).clamp(min=0)[:, None]
    px, qx = p.gather(-1, cand).double(), q.gather(-1, cand).double()  # [N, k]
    ok = (px > 0) & (qx > 0)
    px, qx = px.clamp(min=1e-300), qx.clamp(min=1e-300)
    sT = torch.maximum(pT[:, None, :] / px[:, :, None], qT[:, None, :] / qx[:, :, None]).sum(-1)  # [N, k]
    s_lo = sT + torch.maximum(pR / px, qR / qx)
    s_hi = sT + pR / px + qR / qx
    lower = ((1.0 / s_hi) * ok).sum(-1)
    rest = (m.sum(-1).double() - m.gather(-1, cand).sum(-1).double()).clamp(min=0)
    upper = ((1.0 / s_lo) * ok).sum(-1) + rest
    return lower, upper


def self_check(seed: int = 0) -> float:
    """The closed form against a Monte Carlo of shared Gumbel noise on a small vocabulary."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(1, 12, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(1, 12, generator=g) * 2, -1)
    lower, upper = coupled_agreement(p, q, k=12, top=12)
    noise = -torch.log(-torch.log(torch.rand(400_000, 12, generator=g)))
    mc = ((p.log() + noise).argmax(-1) == (q.log() + noise).argmax(-1)).double().mean()
    assert float(upper - lower) < 1e-5 and abs(float(lower) - float(mc)) < 0.005, (float(lower), float(mc))
    return float(lower)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", help="a results file of the target's temperature-1 texts (its 'id's name the prompts)")
    ap.add_argument("prompts", help="the input those results answered")
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--quant", default=None, help="int8: both models' weights in int8 (CPU)")
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--candidates", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    self_check()
    tcfg = ModelConfig(source=args.target, dtype="float32", device="cpu", quant=args.quant)
    dcfg = ModelConfig(source=args.draft, dtype="float32", device="cpu", quant=args.quant)
    target, draft = load_models(tcfg, dcfg)
    tok = target.tokenizer
    enc = PromptEncoder(tok, None)
    reqs = {}
    for i, r in enumerate(read_requests(args.prompts)):
        reqs[str(getattr(r, "id", i))] = r
    outs = [json.loads(line) for line in open(args.results)][: args.limit]
    rs_sum = co_sum = co_rest = greedy = n = 0.0
    per_record = []
    t0 = time.perf_counter()
    with torch.no_grad():
        for o in outs:
            req = reqs.get(str(o["id"]))
            if req is None or not o.get("output"):
                continue
            prompt = enc.tokenize(req)
            out = tok(o["output"], add_special_tokens=False).input_ids
            ids = torch.tensor([prompt + out])
            lo, hi = len(prompt) - 1, len(prompt) + len(out) - 1
            p = torch.softmax(target.model(input_ids=ids).logits[0, lo:hi].float(), -1)
            q = torch.softmax(draft.model(input_ids=ids).logits[0, lo:hi].float(), -1)
            V = min(p.shape[-1], q.shape[-1])
            p, q = p[:, :V] / p[:, :V].sum(-1, keepdim=True), q[:, :V] / q[:, :V].sum(-1, keepdim=True)
            rs = torch.minimum(p, q).sum(-1).double()
            co, co_hi = coupled_agreement(p, q, args.candidates)
            gr = (p.argmax(-1) == q.argmax(-1)).double()
            rs_sum += float(rs.sum())
            co_sum += float(co.sum())
            co_rest += float((co_hi - co).sum())
            greedy += float(gr.sum())
            n += len(out)
            per_record.append({"id": o["id"], "positions": len(out), "rejection_sampling": round(float(rs.mean()), 4),
                               "coupled": round(float(co.mean()), 4)})
            print(f"{o['id']}: {len(out)} positions, rejection sampling {float(rs.mean()):.3f}, "
                  f"coupled {float(co.mean()):.3f}", file=sys.stderr)
    summary = {
        "target": args.target, "draft": args.draft, "quant": args.quant, "records": len(per_record),
        "positions": int(n), "rejection_sampling": round(rs_sum / n, 4), "coupled": round(co_sum / n, 4),
        "coupled_upper": round((co_sum + co_rest) / n, 4), "greedy_agreement": round(greedy / n, 4),
        "seconds": round(time.perf_counter() - t0, 1), "per_record": per_record,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "per_record"}))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(summary, fh, indent=1)


if __name__ == "__main__":
    main()
