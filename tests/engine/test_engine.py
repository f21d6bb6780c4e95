"""The speculative loop against independent oracles.

Strict greedy speculative output must equal transformers' own greedy generate() token for
token; MARS output is replayed through one full target forward pass and every emitted token
must be the target's top-1, or its top-2 at a relaxable position.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from marscli.config import DraftConfig, ModelConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import RowDrafters
from marscli.engine import build_engine
from marscli.engine.scheduler import Engine
from marscli.engine.sequence import FINISH_LENGTH, FINISH_STOP
from marscli.models.loading import load_model
from tests.engines import PROMPTS, RunnerUpDrafter, encode, make_engine
from tests.oracles import hf_greedy, replay_mars


@pytest.mark.parametrize("kind", ["none", "ngram", "model", "self"])
def test_strict_greedy_matches_transformers_generate(oracle, target, draft, kind):
    drafter_model = {"model": draft, "self": target}.get(kind)
    engine = make_engine(target, "model" if kind == "self" else kind, drafter_model)
    total = {"drafted": 0, "accepted": 0}
    for text in PROMPTS:
        ids = encode(target, text)
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        assert res.token_ids == hf_greedy(oracle, ids, 40), text
        total["drafted"] += res.stats.drafted
        total["accepted"] += res.stats.accepted
        assert res.stats.emitted == len(res.token_ids)
    if kind == "self":  # a drafter identical to the target: everything is accepted
        assert total["drafted"] > 0 and total["accepted"] == total["drafted"]
    if kind == "model":  # a random drafter: drafts are tried and mostly rejected
        assert total["drafted"] > 0 and total["accepted"] < total["drafted"] / 2
    if kind == "ngram":
        assert total["drafted"] > 0 and total["accepted"] > 0


def test_adaptive_draft_length_is_exact_and_deterministic(oracle, target):
    engine = make_engine(target, "ngram", adaptive=True, k=8)
    for text in PROMPTS:
        ids = encode(target, text)
        # the same job twice: without the job corpus, b would draft from a's output
        engine.forget_earlier_records()
        a = engine.generate_ids(ids, SamplingParams(max_tokens=48))
        engine.forget_earlier_records()
        b = engine.generate_ids(ids, SamplingParams(max_tokens=48))
        assert a.token_ids == hf_greedy(oracle, ids, 48)
        assert a.stats.to_dict() == b.stats.to_dict()


def test_mars_with_infinite_theta_is_strict(target, draft):
    strict = make_engine(target, "model", draft)
    mars = make_engine(target, "model", draft, verify=VerifyConfig("mars", math.inf))
    for text in PROMPTS:
        ids = encode(target, text)
        a = strict.generate_ids(ids, SamplingParams(max_tokens=32))
        b = mars.generate_ids(ids, SamplingParams(max_tokens=32))
        assert a.token_ids == b.token_ids
        assert b.stats.relaxed == 0 and b.stats.relaxable == 0


@pytest.mark.parametrize("margin,theta", [("prob-ratio", 0.3), ("logit-ratio", 0.5)])
def test_mars_greedy_emits_only_top1_or_relaxable_top2(target, margin, theta):
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 3)),
                    VerifyConfig("mars", theta, margin).rule, cfg)
    relaxed_total = 0
    for text in PROMPTS:
        ids = encode(target, text)
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        n_top2 = replay_mars(target, ids, res.token_ids, theta, margin)
        # Relaxed accepts are exactly the emitted tokens that are not the target's top-1
        # (corrections and bonuses are always top-1), unless an EOS cut the step short.
        assert n_top2 == res.stats.relaxed
        relaxed_total += res.stats.relaxed
    assert relaxed_total > 0, "the test must exercise relaxed acceptances"


def test_sampling_is_deterministic_per_seed(target, draft):
    engine = make_engine(target, "model", draft)
    ids = encode(target, PROMPTS[0])
    s = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=7)
    a = engine.generate_ids(ids, s)
    b = engine.generate_ids(ids, s)
    c = engine.generate_ids(ids, SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=8))
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_max_tokens_and_finish_reason(oracle, target):
    engine = make_engine(target, "ngram", k=6)
    ids = encode(target, PROMPTS[2])
    for n in (1, 2, 5, 17):
        res = engine.generate_ids(ids, SamplingParams(max_tokens=n))
        ref = hf_greedy(oracle, ids, n)
        assert res.token_ids == ref
        eos = target.tokenizer.eos_token_id
        expected = FINISH_STOP if ref and ref[-1] == eos else FINISH_LENGTH
        assert res.finish_reason == expected
        assert len(res.token_ids) <= n


def test_eos_stops_generation(oracle, target):
    engine = make_engine(target, "ngram")
    eos = target.tokenizer.eos_token_id
    # Make EOS the most likely token after a few steps by biasing the lm_head bias-free:
    # instead, look for a prompt whose greedy continuation contains EOS.
    ids = encode(target, PROMPTS[3])
    full = hf_greedy(oracle, ids, 200)
    res = engine.generate_ids(ids, SamplingParams(max_tokens=200))
    assert res.token_ids == full
    if eos in full:
        assert res.finish_reason == FINISH_STOP and res.token_ids[-1] == eos
    # pretend the 6th generated token is an end-of-sequence token
    engine.settings = dataclasses.replace(engine.settings, eos=frozenset({full[5]}))
    res = engine.generate_ids(ids, SamplingParams(max_tokens=200))
    assert res.token_ids == full[: full.index(full[5]) + 1]
    assert res.finish_reason == FINISH_STOP


def test_stop_string_truncates_text(target):
    engine = make_engine(target, "ngram")
    ids = encode(target, PROMPTS[1])
    full = engine.generate_ids(ids, SamplingParams(max_tokens=40))
    text = full.text
    assert len(text) > 12
    stop = text[8:11]
    res = engine.generate_ids(ids, SamplingParams(max_tokens=40, stop=(stop,)))
    assert res.finish_reason == FINISH_STOP
    assert res.text == text[: text.find(stop)]
    assert stop not in res.text
    # The completion ends at the token that completed the stop string.
    assert res.token_ids == full.token_ids[: len(res.token_ids)]
    decoded = target.tokenizer.decode(res.token_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in target.tokenizer.decode(res.token_ids[:-1], skip_special_tokens=True)


def test_padded_draft_vocabulary(oracle, target, tiny_factory, tiny_tokenizer, tmp_path):
    padded = load_model(ModelConfig(str(tiny_factory(tmp_path / "padded", seed=3, layers=1, vocab_pad=7,
                                                       tokenizer=tiny_tokenizer)), dtype="float32", device="cpu"))
    engine = make_engine(target, "model", padded)
    ids = encode(target, PROMPTS[0])
    assert engine.generate_ids(ids, SamplingParams(max_tokens=20)).token_ids == hf_greedy(oracle, ids, 20)
    # Sampling with draft probabilities of a different width than the target's logits.
    res = engine.generate_ids(ids, SamplingParams(temperature=0.8, max_tokens=20, seed=1))
    assert len(res.token_ids) >= 1


@pytest.mark.parametrize("curve", ["flat", "steep"])
@pytest.mark.parametrize("batch_size", [1, 4])
def test_cost_aware_lengths_keep_strict_greedy_exact(oracle, target, curve, batch_size):
    """The per-batch draft-length choice changes how much is drafted, never what strict
    greedy decoding emits: on a flat cost curve rows draft, on a steep one the batch decodes
    plainly (L = 0) throughout."""
    from marscli.engine.costs import StepCosts

    costs = {"flat": StepCosts((1, 4), (1, 9), ((1.0, 1.0), (1.0, 1.0)), (0.0, 0.0)),
             "steep": StepCosts((1, 4), (1, 9), ((1.0, 9.0), (1.0, 9.0)), (0.0, 0.0))}[curve]
    cfg = DraftConfig(kind="ngram", num_draft_tokens=6, adaptive=True)
    engine = build_engine(target, None, VerifyConfig(), cfg, batch_size=batch_size)
    engine.costs = costs
    ids = {p: encode(target, p) for p in PROMPTS}
    got = dict(engine.run(PROMPTS, lambda p: (ids[p], SamplingParams(max_tokens=40))))
    for p in PROMPTS:
        assert got[p].token_ids == hf_greedy(oracle, ids[p], 40), p
    drafted = sum(r.stats.drafted for r in got.values())
    steps = sum(r.stats.steps for r in got.values())
    if curve == "flat":
        assert drafted > 0 and sum(r.stats.accepted for r in got.values()) > 0
    else:  # t(n) = n: no draft can pay for itself, every step is plain
        assert drafted == 0 and steps == sum(len(r.token_ids) for r in got.values())
