"""Hybrid drafting (marscli.drafters.hybrid, `--draft ngram+MODEL`): prompt lookup where its
match promises more tokens per second, the draft model elsewhere.

The choice is checked on synthetic cost curves; the engine with a hybrid drafter against
plain decoding and transformers' generate() (strict greedy), with both sources really used.
"""

from __future__ import annotations

import json

import pytest
import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import DraftOffer, Proposal, RowDrafters, choose_draft_lengths, expected_tokens
from marscli.drafters.factory import build_drafter
from marscli.drafters.hybrid import HybridCosts, HybridDrafter, best_rate
from marscli.engine import build_engine
from marscli.engine.costs import StepCosts
from marscli.engine.scheduler import Engine
from marscli.verification.registry import Rule
from tests.oracles import hf_greedy

PROMPTS = [
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]


def curve(draft_share: float) -> StepCosts:
    """A CPU-like curve: verifying 9 tokens costs 1.2 one-token forwards; a draft token
    costs draft_share of one."""
    return StepCosts((1,), (1, 9), ((1.0, 1.2),), (draft_share,), {"test": draft_share}, "measured")


class FakeEngine:
    """What HybridCosts reads of its engine."""

    def __init__(self, costs, reference=None, relaxes=False, solo=False):
        self.costs, self.reference, self.relaxes, self.solo_lengths = costs, reference or costs, relaxes, solo

    def fixed_schedule(self, sampling):
        return self.relaxes or not sampling.greedy


def hybrid(costs: StepCosts, **kw) -> HybridDrafter:
    return HybridDrafter(None, None, HybridCosts(FakeEngine(costs, **kw)))


# --- the choice -------------------------------------------------------------------------


def test_a_long_reliable_match_is_taken_and_a_poor_one_is_not():
    d = hybrid(curve(0.3))
    model = DraftOffer(6, 0.7)
    assert d.choose(DraftOffer(6, 0.9), model) == "ngram"  # free and likely: copy it
    assert d.choose(DraftOffer(1, 0.3), model) == "model"  # one doubtful token: the model pays more
    assert d.choose(DraftOffer(0), model) == "model"  # no match
    assert d.choose(DraftOffer(2, 0.5), DraftOffer(0)) == "ngram"  # the model may not draft now


def test_the_choice_is_by_tokens_per_second_and_follows_the_draft_cost():
    """The same offers: a dear draft model loses to a middling match that a cheap one beats."""
    ngram, model = DraftOffer(3, 0.6), DraftOffer(6, 0.85)
    dear, cheap = curve(0.9), curve(0.02)
    for costs, want in ((dear, "ngram"), (cheap, "model")):
        free = best_rate(ngram, lambda L, c=costs: c.target(1, L + 1))
        paid = best_rate(model, lambda L, c=costs: c.step(1, L))
        assert (free >= paid) == (want == "ngram")
        assert hybrid(costs).choose(ngram, model) == want


def test_relaxed_and_sampled_rows_choose_by_the_reference_curve():
    """Measured costs say the model is cheap, the reference says it is dear: a strict greedy
    row follows the measurement, a relaxed or sampled row the reference."""
    ngram, model = DraftOffer(3, 0.6), DraftOffer(6, 0.85)
    measured, reference = curve(0.02), curve(0.9)
    assert hybrid(measured, reference=reference).choose(ngram, model) == "model"
    assert hybrid(measured, reference=reference, relaxes=True).choose(ngram, model) == "ngram"
    sampled = hybrid(measured, reference=reference)
    sampled.sampling = SamplingParams(temperature=0.8)
    assert sampled.choose(ngram, model) == "ngram"
    assert hybrid(measured, reference=reference, solo=True).choose(ngram, model) == "ngram"


def test_free_offers_pay_no_drafting_in_the_length_choice():
    costs = curve(0.5)

    def step(L):
        return costs.step(1, L)

    def draft(L):
        return costs.draft(1, L)
    offer = DraftOffer(6, 0.8)
    paid = choose_draft_lengths([offer], step, draft_seconds=draft)[0]
    free = choose_draft_lengths([DraftOffer(6, 0.8, free=True)], step, draft_seconds=draft)[0]
    assert paid < free == 6
    rates = {L: expected_tokens(0.8, L) / costs.target(1, L + 1) for L in range(7)}
    assert rates[free] == max(rates.values())
    # without draft_seconds every offer pays, as before hybrid drafting
    assert choose_draft_lengths([DraftOffer(6, 0.8, free=True)], step)[0] == paid
    # a free row beside a paid one: the step pays the paid row's drafts only
    both = choose_draft_lengths([DraftOffer(6, 0.8, free=True), DraftOffer(2, 0.8)], step, draft_seconds=draft)
    assert both[0] >= paid and both[1] <= 2


# --- in the engine ------------------------------------------------------------------------


@pytest.mark.parametrize("draft_share", [0.02, 0.9])
def test_strict_hybrid_drafting_is_plain_decoding_and_uses_both_sources(target, draft, oracle, draft_share):
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=4, hybrid=True)
    made: list[HybridDrafter] = []
    costs = HybridCosts()

    def factory():
        made.append(build_drafter(cfg, target, draft, None, costs))
        return made[-1]
    rows = RowDrafters(factory)
    rows.hybrid_costs = costs
    engine = Engine(target, rows, Rule("strict"), cfg, 1, costs=curve(draft_share))
    plain = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        assert res.token_ids == plain.generate_ids(ids, SamplingParams(max_tokens=40)).token_ids, text
        assert res.token_ids == hf_greedy(oracle, ids, 40), text
    assert all(isinstance(d, HybridDrafter) for d in made)
    steps = {src: sum(d.steps[src] for d in made) for src in ("ngram", "model")}
    assert steps["ngram"] > 0 and steps["model"] > 0, steps


def test_a_batch_of_hybrid_rows_equals_each_row_alone(target, draft):
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=4, hybrid=True)
    engine = build_engine(target, draft, VerifyConfig(), cfg, batch_size=3)
    alone = build_engine(target, None, VerifyConfig(), DraftConfig(kind="none"))
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    got = dict(engine.run(range(len(prompts)), lambda i: (prompts[i], SamplingParams(max_tokens=32))))
    for i, ids in enumerate(prompts):
        assert got[i].token_ids == alone.generate_ids(ids, SamplingParams(max_tokens=32)).token_ids, i


def test_a_deterministic_draft_beside_sampled_drafts_is_verified_with_its_one_hot_q():
    """A hybrid row whose n-gram drafted (no q) in a step where another row's draft model
    sampled (its q): the n-gram row's q is one-hot at its drafts, never zeros (which would
    accept any draft: p / 0)."""
    V = 11
    sampled = torch.softmax(torch.randn(3, V, generator=torch.Generator().manual_seed(0)), dim=-1)
    proposals = [Proposal([3, 5]), Proposal([1, 2, 4], sampled), Proposal([7])]
    q = Engine._draft_probs(proposals, [2, 3, 0], 3, torch.zeros(3, 4, V))
    assert q.shape == (3, 3, V)
    assert q[0, 0, 3] == 1 and q[0, 1, 5] == 1 and q[0, 0].sum() == 1 and q[0, 1].sum() == 1
    assert q[0, 2].sum() == 0  # past the row's drafts: never read
    assert torch.equal(q[1], sampled)
    assert q[2].sum() == 0  # drafted nothing this step
    assert Engine._draft_probs([Proposal([3, 5]), Proposal([1])], [2, 1], 2, torch.zeros(2, 3, V)) is None


def test_sampled_hybrid_rows_in_a_batch_equal_each_row_alone(target, draft, monkeypatch):
    """Sampling with hybrid drafting at batch size 3: n-gram rows and draft-model rows share
    steps, and every record's tokens and statistics are what it decodes alone (batch size 1).
    Before the fix the n-gram rows of such steps accepted every draft."""
    mixed = []
    real = Engine._draft_probs

    def spy(proposals, ks, K, logits):
        kinds = {p.probs is None for p, k in zip(proposals, ks) if k > 0}
        mixed.append(kinds == {True, False})
        return real(proposals, ks, K, logits)

    monkeypatch.setattr(Engine, "_draft_probs", staticmethod(spy))
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=4, hybrid=True)
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS * 2]
    settings = [SamplingParams(temperature=0.9, max_tokens=40, seed=20 + i) for i in range(len(prompts))]
    alone = build_engine(target, draft, VerifyConfig(), cfg, batch_size=1)
    want = [alone.generate_ids(ids, s) for ids, s in zip(prompts, settings)]
    mixed.clear()
    engine = build_engine(target, draft, VerifyConfig(), cfg, batch_size=3)
    got = dict(engine.run(range(len(prompts)), lambda i: (prompts[i], settings[i])))
    assert any(mixed), "the batch must mix n-gram and draft-model rows in a step"
    for i, w in enumerate(want):
        assert got[i].token_ids == w.token_ids, i
        assert got[i].stats.to_dict() == w.stats.to_dict(), i


# --- the command line ---------------------------------------------------------------------


def test_draft_ngram_plus_model_reaches_spec_and_fingerprint(runner, tiny_model_dir, tiny_draft_dir, tmp_path):
    from marscli.cli import app

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hello world, hello marscli; hello world"}) + "\n")
    out = tmp_path / "out.jsonl"
    base = ["generate", str(src), "--target", str(tiny_model_dir), "--max-tokens", "12", "--verify", "strict"]
    r = runner.invoke(app, [*base, "--draft", f"ngram+{tiny_draft_dir}", "-o", str(out)])
    assert r.exit_code == 0, r.stderr
    rec = json.loads(out.read_text())
    assert rec["spec"]["drafter"] == "model" and rec["spec"]["hybrid"] is True
    plain = tmp_path / "plain.jsonl"
    assert runner.invoke(app, [*base, "--draft", "none", "-o", str(plain)]).exit_code == 0
    assert json.loads(plain.read_text())["output"] == rec["output"]
    # resuming with the draft model alone is a different run
    r = runner.invoke(app, [*base, "--draft", str(tiny_draft_dir), "-o", str(out), "--resume"])
    assert r.exit_code != 0 and "drafter" in r.stderr
    for bad in ("ngram+", "ngram+ngram", "ngram+none", "ngram+eagle3:x"):
        r = runner.invoke(app, [*base, "--draft", bad])
        assert r.exit_code != 0 and "--draft ngram+MODEL needs a draft model" in r.stderr, bad
