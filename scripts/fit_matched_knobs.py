#!/usr/bin/env python
"""Fit every relaxed rule's main knob to the relaxed share of a reference method, on a
calibration split: the knobs `bench --methods` then takes explicitly, so that a long table can
be measured in chunks (one per session) with the same knobs and merged
(scripts/report.py merge).

`bench --match-relax-rate S` fits every relaxed method, MARS included, to a share S given in
advance; this fits the other rules to the share that the reference (e.g. MARS at a profile's
theta) relaxes on the same split, and keeps the reference as it is. The collection is bench's
own (marscli.jobs.bench_match.collect_calibration: strict decoding, batch size 1, solo draft
lengths, the bench's loop guard), and so is the fit (bench_match.fit_to_share, which bench
--match-relax-rate calls too: by the relaxed drafts the replay accepts per verified draft
position); each rule's entry has the keys of the bench report's match_relax_rate.methods.

    python scripts/fit_matched_knobs.py --calibrate-on CALIB.jsonl --reference mars@0.8604 \\
        --rules ratio,topk,typical,regret --target qwen2.5-coder-1.5b-instruct \\
        --draft qwen2.5-coder-0.5b-instruct --max-tokens 256 --out knobs.json

Prints (stdout) the methods string for bench and writes --out: the reference's share and each
rule's label, knobs and replayed shares.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibrate-on", required=True, help="calibration prompts (JSONL, any format bench reads)")
    ap.add_argument("--reference", required=True,
                    help="the method whose relaxed share the rules match, e.g. mars@0.8604")
    ap.add_argument("--rules", default="ratio,topk,typical,regret",
                    help="rule templates, as bench --match-relax-rate takes them")
    ap.add_argument("--input", help="the prompts bench will measure (their prompts are dropped from the split)")
    ap.add_argument("--limit", type=int, help="with --input: its first N records")
    ap.add_argument("--calibration-records", type=int, default=20)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--draft-quant", help="quantized draft-model weights, as bench --draft-quant (e.g. int8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="the split is decoded at this temperature (as bench --temperature)")
    ap.add_argument("--seed", default="0", help="and this seed (bench's first --seeds)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", help="write the fit here (JSON)")
    args = ap.parse_args(argv)

    from marscli.bench.methods import parse_methods, read_prompt_records
    from marscli.calibration.policies import relaxed_per_position
    from marscli.config import GenerationOptions
    from marscli.jobs.bench import bench_config
    from marscli.jobs.bench_match import collect_calibration, fit_to_share
    from marscli.jobs.setup import load_models

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    # The share is a placeholder: only the rule templates and the split come from this config.
    opts = GenerationOptions(target=args.target, draft=args.draft, dtype=args.dtype, device=args.device,
                             draft_quant=args.draft_quant)
    cfg = bench_config(args.input or args.calibrate_on, opts, methods=args.rules,
                       max_tokens=args.max_tokens, limit=args.limit, match_relax_rate=0.5,
                       temperature=args.temperature, seeds=args.seed,
                       calibrate_on=args.calibrate_on,
                       calibration_records=args.calibration_records, note=log)
    (reference,) = parse_methods(args.reference, ())
    ref_rule = reference.verify_rule(cfg.margin)
    if ref_rule is None or ref_rule.name == "strict":
        raise SystemExit(f"--reference {args.reference}: not a relaxed method")
    measured = read_prompt_records(args.input, args.limit)[0] if args.input else []
    t0 = time.perf_counter()
    target, draft = load_models(cfg.target, cfg.draft_model, log, kind=cfg.draft.kind)
    # The measured file given as its own calibration split: its records after --limit (as bench).
    same = bool(args.input) and os.path.samefile(args.input, args.calibrate_on)
    skip = (args.limit or 0) if same else 0
    calibration = read_prompt_records(args.calibrate_on, skip + args.calibration_records)[0][skip:]
    split = collect_calibration(dataclasses.replace(cfg, match_relax_rate=None), calibration, measured, target,
                                draft, log)
    data = split.data
    at_reference = data.replay(ref_rule)
    share = relaxed_per_position(data, at_reference)
    log(f"{reference.name}: {share:.4f} relaxed drafts per verified position on {data.positions} positions "
        f"({data.records} records, {data.tokens} tokens)")
    fitted = {}
    for m in cfg.methods:
        rule, fit = fit_to_share(data, m.rule, share, m.name)
        fitted[rule.label()] = fit
        log(f"{m.name} -> {rule.label()}: {fit['relaxed_per_position_calibration']:.4f} relaxed per position "
            f"(relax rate {fit['relax_rate_calibration']:.4f})")
    doc = {"reference": reference.name, "share": share, "relax_rate_reference": at_reference.relax_rate,
           "calibration": {"file": split.source, "records": data.records, "positions": data.positions,
                           "tokens": data.tokens, "dropped_overlap": split.dropped, "skipped": split.skipped},
           "max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed,
           "target": args.target, "draft": args.draft,
           "draft_quant": args.draft_quant,
           "seconds": round(time.perf_counter() - t0, 1), "rules": fitted,
           "methods": ",".join([reference.name, *fitted])}
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        os.replace(tmp, args.out)
    print(doc["methods"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
