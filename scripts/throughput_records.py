#!/usr/bin/env python
"""Records for throughput benchmarks (docs/results.md, "Batch jobs"), made the same way every time.

    labelling N   short review-labelling prompts, 9-15 tokens on SmolLM2's tokenizer
                  ("Review: The battery broke after a week. Sentiment:")
    instructed N  the labelling prompts after one shared instruction (~20 tokens)
    fewshot N     the same questions after one shared ~550-token instruction with 40 labelled
                  examples (a few-shot prompt: what a prefix cache is for)

    python scripts/throughput_records.py labelling 160 > labelling.jsonl
    python scripts/throughput_records.py fewshot 200 > fewshot.jsonl
    marscli bench labelling.jsonl --throughput --batch-size 16,64 --methods hf-generate,ar,mars --max-tokens 4

JSONL on stdout, one {"id", "prompt"} per line; seeded, so a file is the same on every machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

SUBJECTS = ["the battery", "this blender", "the hotel room", "customer support", "the delivery", "this novel",
            "the headphones", "the app", "the pizza", "this laptop", "the movie", "the shoes", "the staff",
            "the camera", "this jacket", "the update"]
VERDICTS = ["was great", "broke after a week", "is totally worth it", "was a waste of money",
            "arrived late and damaged", "works exactly as described", "made me smile", "is too loud",
            "exceeded my expectations", "was rude and slow", "feels cheap", "is my new favourite"]
EXAMPLES = 40
INSTRUCTION = "You label customer reviews. Answer with one word, positive or negative, for the review below.\n"


def review(rng: random.Random) -> str:
    return f"Review: {rng.choice(SUBJECTS).capitalize()} {rng.choice(VERDICTS)}."


def labelling(n: int, rng: random.Random) -> list[dict]:
    return [{"id": f"l{i}", "prompt": f"{review(rng)} Sentiment:"} for i in range(n)]


def instructed(n: int, rng: random.Random) -> list[dict]:
    return [{"id": f"i{i}", "prompt": f"{INSTRUCTION}{review(rng)} Sentiment:"} for i in range(n)]


def fewshot(n: int, rng: random.Random) -> list[dict]:
    shots = "".join(f"{review(rng)} Sentiment: {rng.choice(['positive', 'negative'])}\n" for _ in range(EXAMPLES))
    prefix = "Label each review as positive or negative.\n" + shots
    return [{"id": f"f{i}", "prompt": f"{prefix}{review(rng)} Sentiment:"} for i in range(n)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("labelling", "instructed", "fewshot"))
    p.add_argument("n", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    records = {"labelling": labelling, "instructed": instructed, "fewshot": fewshot}[args.kind](args.n, rng)
    for r in records:
        sys.stdout.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
