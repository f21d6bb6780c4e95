#!/usr/bin/env python
"""What would prompt lookup gain from the job's earlier records? An offline simulation.

Reads the prompts and greedy outputs of a finished strict run (`generate --token-ids`) and
replays greedy verification with two n-gram drafters that draft whenever they find a match
(K tokens, no cost policy): the engine's own (the record's prompt and output so far,
longest suffix match n = NGRAM_MAX..1, latest occurrence), and the same with a fallback to
an index of the earlier records' prompts and outputs when the record's own match is shorter
than NGRAM_MAX (the idea of SuffixDecoding, Oliaro et al. 2024). Prints tau (tokens per
step) per record and overall. Nothing is timed: it says how many target forwards a drafter
would save, not how fast it would run.

    marscli generate /tmp/p16.jsonl --max-tokens 64 --verify strict --token-ids -o /tmp/p16_out.jsonl
    python scripts/sim_job_ngram.py /tmp/p16.jsonl /tmp/p16_out.jsonl
"""

from __future__ import annotations

import argparse
import json


def own_match(seq: list[int], nmax: int, K: int) -> tuple[int, list[int]]:
    """(n, continuation) of the longest suffix n-gram's latest earlier occurrence."""
    for n in range(nmax, 0, -1):
        if len(seq) <= n:
            continue
        key = seq[-n:]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start:start + n] == key:
                return n, seq[start + n:start + n + K]
    return 0, []


def simulate(prompts, outputs, *, job: bool, nmax: int = 3, K: int = 8):
    corpus: dict[tuple[int, ...], list[int]] = {}
    steps = 0
    per = []
    for prompt, out in zip(prompts, outputs):
        seq, t, rs = list(prompt), 0, 0
        while t < len(out):
            n, cand = own_match(seq, nmax, K)
            if job and n < nmax:
                for m in range(nmax, n, -1):
                    hit = corpus.get(tuple(seq[-m:])) if len(seq) >= m else None
                    if hit:
                        cand = hit[:K]
                        break
            acc = 0
            for a, b in zip(cand, out[t:]):
                if a != b:
                    break
                acc += 1
            emit = min(acc + 1, len(out) - t)
            seq += out[t:t + emit]
            t += emit
            rs += 1
        steps += rs
        per.append(len(out) / rs if rs else 0.0)
        full = list(prompt) + out
        for stop in range(1, len(full)):
            for m in range(1, nmax + 1):
                if stop - m >= 0:
                    corpus[tuple(full[stop - m:stop])] = full[stop:stop + K]
    return sum(len(o) for o in outputs) / steps, per


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts")
    p.add_argument("results", help="generate's output with --token-ids, same order")
    p.add_argument("--max-tokens", type=int, default=64, help="as the run (prompt fitting)")
    args = p.parse_args(argv)
    from marscli.config import DraftConfig, ModelConfig, VerifyConfig
    from marscli.engine import build_engine
    from marscli.io.input_index import read_input
    from marscli.jobs.setup import load_models

    target, _ = load_models(ModelConfig(), None)
    engine = build_engine(target, None, VerifyConfig(), DraftConfig(), 1)
    items, _ = read_input(args.prompts)
    outputs = [json.loads(line)["token_ids"] for line in open(args.results)]
    prompts = [engine.prompts.fit_prompt(engine.prompts.tokenize(it), truncate="left", max_tokens=args.max_tokens)[0]
               for it in items]
    for job in (False, True):
        tau, per = simulate(prompts, outputs, job=job)
        name = "own prompt and output + the job's earlier records" if job else "own prompt and output"
        print(f"{name}: tau {tau:.3f}; per record {' '.join(f'{x:.2f}' for x in per)}")


if __name__ == "__main__":
    main()
