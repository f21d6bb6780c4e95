"""The CUDA paths (opt-in: `pytest -m cuda` on a machine with a GPU; README, "Tests").

CI has no GPU, so these are deselected there by the `cuda` marker (pyproject's addopts) rather
than skipped: they run where a GPU is lent (docs/gpu.md gives the last run's figures).
Exactness is relative to the model as loaded on the device: strict speculative output equals
the same loaded model's plain greedy decoding in transformers' generate() (float32, bfloat16,
bitsandbytes 8-bit and 4-bit, device_map), and a batch of rows equals each row alone.
"""

from __future__ import annotations

import pytest
import torch

from marscli.config import ModelConfig, SamplingParams, VerifyConfig
from marscli.models.loading import load_model
from marscli.verification.registry import MARS
from tests.engines import make_engine
from tests.oracles import hf_greedy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (pytest -m cuda on a GPU machine)"),
]

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]
N = 32


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def cuda_pair(request, tiny_model_dir, tiny_draft_dir):
    t = load_model(ModelConfig(str(tiny_model_dir), dtype=request.param, device="cuda"))
    d = load_model(ModelConfig(str(tiny_draft_dir), dtype=request.param, device="cuda"), role="draft")
    assert t.model.device.type == "cuda" and next(t.model.parameters()).dtype == getattr(torch, request.param)
    return t, d


@pytest.mark.parametrize("kind", ["none", "ngram", "model"])
def test_strict_greedy_on_cuda_is_the_loaded_models_generate(cuda_pair, kind):
    target, draft = cuda_pair
    engine = make_engine(target, kind, draft if kind == "model" else None, adaptive=True)
    drafted = 0
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=N))
        assert res.token_ids == hf_greedy(target.model, ids, N), text
        drafted += res.stats.drafted
    assert kind == "none" or drafted > 0


def test_strict_greedy_with_a_draft_model_tree_on_cuda(cuda_pair):
    target, draft = cuda_pair
    engine = make_engine(target, "model", draft, adaptive=True, tree_top_k=2, tree_tokens=12)
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        got = engine.generate_ids(ids, SamplingParams(max_tokens=N)).token_ids
        assert got == hf_greedy(target.model, ids, N), text


@pytest.mark.parametrize("verify", ["strict", "mars"])
def test_a_batch_on_cuda_equals_each_row_alone(cuda_pair, verify):
    target, draft = cuda_pair
    vc = VerifyConfig(MARS, theta=0.5) if verify == "mars" else VerifyConfig()
    batched = make_engine(target, "model", draft, adaptive=True, verify=vc, batch_size=4)
    alone = make_engine(target, "model", draft, adaptive=True, verify=vc)
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    got = dict(batched.run(range(len(prompts)), lambda i: (prompts[i], SamplingParams(max_tokens=N))))
    for i, ids in enumerate(prompts):
        assert got[i].token_ids == alone.generate_ids(ids, SamplingParams(max_tokens=N)).token_ids, i


def test_sampling_on_cuda_is_reproducible(cuda_pair):
    target, draft = cuda_pair
    engine = make_engine(target, "model", draft, adaptive=True, verify=VerifyConfig(MARS, theta=0.5))
    ids = target.tokenizer(PROMPTS[1]).input_ids
    sp = SamplingParams(max_tokens=N, temperature=1.0, seed=7)
    assert engine.generate_ids(ids, sp).token_ids == engine.generate_ids(ids, sp).token_ids


@pytest.mark.parametrize("quant", ["int8", "4bit"])
def test_bitsandbytes_strict_is_the_quantized_models_generate(tiny_model_dir, tiny_draft_dir, quant):
    pytest.importorskip("bitsandbytes")
    target = load_model(ModelConfig(str(tiny_model_dir), device="cuda", quant=quant))
    draft = load_model(ModelConfig(str(tiny_draft_dir), device="cuda", quant=quant), role="draft")
    assert target.identity.get("quantization"), target.identity
    for kind in ("ngram", "model"):
        engine = make_engine(target, kind, draft if kind == "model" else None, adaptive=True)
        for text in PROMPTS:
            ids = target.tokenizer(text).input_ids
            got = engine.generate_ids(ids, SamplingParams(max_tokens=N)).token_ids
            assert got == hf_greedy(target.model, ids, N), (kind, text)


def test_device_map_auto_decodes_as_one_device(tiny_model_dir):
    whole = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device="cuda"))
    mapped = load_model(ModelConfig(str(tiny_model_dir), dtype="float32", device_map="auto"))
    assert next(mapped.model.parameters()).device.type == "cuda"
    a, b = make_engine(whole, "ngram", adaptive=True), make_engine(mapped, "ngram", adaptive=True)
    for text in PROMPTS:
        ids = whole.tokenizer(text).input_ids
        res = b.generate_ids(ids, SamplingParams(max_tokens=N)).token_ids
        assert res == a.generate_ids(ids, SamplingParams(max_tokens=N)).token_ids, text
        assert res == hf_greedy(mapped.model, ids, N), text
