"""The real embedded model (SmolLM2-135M-Instruct): few, purposeful tests, loaded once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marscli.config import DraftConfig, Request, SamplingParams, VerifyConfig
from marscli.engine import SpecEngine, build_drafter

PROMPTS_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "prompts"
MAX_NEW = 40

pytestmark = pytest.mark.embedded


def first_turns(name: str, n: int) -> list[dict]:
    path = PROMPTS_DIR / name
    if not path.exists():
        pytest.fail(f"prompt set {path} is missing: tests read ../shared/data/prompts")
    with path.open() as f:
        recs = [json.loads(next(f)) for _ in range(n)]
    return recs


def test_ngram_strict_greedy_equals_transformers_generate(embedded_model):
    target = embedded_model
    cfg = DraftConfig(kind="ngram", num_draft_tokens=8)
    engine = SpecEngine(target, build_drafter(cfg, target), VerifyConfig(), cfg)
    recs = first_turns("humaneval.jsonl", 2) + first_turns("gsm8k.jsonl", 1)
    accepted = 0
    for rec in recs:
        req = Request(0, 1, str(rec["question_id"]), messages=[{"role": "user", "content": rec["turns"][0]}])
        ids = engine.encode(req)
        res = engine.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW))
        ref = target.model.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False, max_new_tokens=MAX_NEW,
        )[0, len(ids):].tolist()
        assert res.token_ids == ref, rec["question_id"]
        accepted += res.stats.accepted
    assert accepted > 0, "prompt lookup should find something to copy in code prompts"
