"""The rulebook's seams: Rule, its per-position decision on torch and numpy alike, and the
batch-wide verification call (hand-written logits over a 10-token vocabulary)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from marscli.config import SamplingParams, VerifyConfig
from marscli.verification.chain import step_uniforms, verify, verify_rows
from marscli.verification.registry import LOGIT_RATIO, MARS, PROB_RATIO, RULEBOOK, STRICT, Rule
from marscli.verification.rules import PositionFacts, decide, relaxable

V = 10


def test_strict_never_relaxes_whatever_its_theta():
    stat = torch.tensor([0.1, 0.99, math.inf])
    for theta in (-1.0, 0.0, 0.5, math.inf):
        assert not Rule(STRICT, theta).relaxes
        assert not relaxable(Rule(STRICT, theta), stat).any()
    assert relaxable(Rule(MARS, 0.5), stat).tolist() == [False, True, True]
    assert not Rule(MARS, math.inf).relaxes  # MARS at +inf behaves as strict
    assert VerifyConfig("strict", 0.2).rule == Rule(STRICT, 0.2)  # the name decides, not theta


@pytest.mark.parametrize("bad", [dict(name="lossy"), dict(margin="ratio"), dict(theta=math.nan)])
def test_rule_refuses_unknown_settings(bad):
    with pytest.raises(ValueError):
        Rule(**{"name": MARS, "theta": 0.5, **bad})


def test_decide_is_the_same_on_numpy_and_torch():
    """Calibration's replay runs rules.decide on numpy arrays; the verifier on tensors."""
    rng = np.random.default_rng(0)
    stat = rng.uniform(0, 1, size=(50, 6))
    in_top2 = rng.uniform(size=(50, 6)) < 0.6
    strict_ok = in_top2 & (rng.uniform(size=(50, 6)) < 0.5)
    for rule in (Rule(STRICT), Rule(MARS, 0.4, PROB_RATIO), Rule(MARS, 0.9, PROB_RATIO)):
        a = decide(rule, PositionFacts({PROB_RATIO: stat}, in_top2, strict_ok))
        b = decide(rule, PositionFacts({PROB_RATIO: torch.tensor(stat)}, torch.tensor(in_top2),
                                      torch.tensor(strict_ok)))
        assert (a.ok == b.ok.numpy()).all() and (a.relaxable == b.relaxable.numpy()).all()
        # the law itself: relaxable positions take any top-2 draft, the others the strict check
        expect = np.where(stat > rule.theta, in_top2, strict_ok) if rule.relaxes else strict_ok
        assert (a.ok == expect).all()


def test_step_uniforms_take_n_plus_one_draws():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    u_acc, u_smp = step_uniforms(g1, 4)
    both = torch.rand(5, generator=g2)
    assert u_acc.tolist() == both[:4].tolist() and u_smp.tolist() == both[4:].tolist()


def _random_step(B: int, K: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    argmax = logits.argmax(-1)
    # drafts: mostly the argmax, sometimes the runner-up, sometimes anything
    runner_up = logits.scatter(-1, argmax.unsqueeze(-1), -math.inf).argmax(-1)
    pick = torch.randint(0, 3, (B, K), generator=g)
    drafts = torch.where(pick == 0, argmax[:, :K], torch.where(pick == 1, runner_up[:, :K],
                                                               torch.randint(0, V, (B, K), generator=g)))
    draft_len = torch.randint(0, K + 1, (B,), generator=g)
    u_acc = torch.rand(B, K, generator=g)
    u_smp = torch.rand(B, generator=g)
    return drafts, logits, draft_len, u_acc, u_smp


@pytest.mark.parametrize("rule", [Rule(STRICT), Rule(MARS, 0.2, PROB_RATIO), Rule(MARS, 0.5, LOGIT_RATIO)])
def test_verify_rows_with_mixed_settings_equals_each_row_alone(rule):
    B, K = 7, 4
    drafts, logits, draft_len, u_acc, u_smp = _random_step(B, K, seed=11)
    settings = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
                SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_p=0.8),
                SamplingParams(temperature=1.0, top_k=3)]
    res = verify_rows(drafts, logits, draft_len, rule, settings, u_accept=u_acc, u_sample=u_smp)
    rows = res.host_rows()
    for b, s in enumerate(settings):
        one = verify(drafts[b: b + 1], logits[b: b + 1], rule=rule, temperature=s.temperature,
                     top_k=s.top_k, top_p=s.top_p, u_accept=None if s.greedy else u_acc[b: b + 1],
                     u_sample=None if s.greedy else u_smp[b: b + 1], draft_len=draft_len[b: b + 1])
        assert rows[b].num_accepted == int(one.num_accepted[0]) and rows[b].next_token == int(one.next_token[0]), b
        assert rows[b].relaxed == one.relaxed[0].long().tolist()
        assert rows[b].relaxable == one.relaxable[0].long().tolist()
        assert rows[b].refused == 0  # no guard: nothing refused
        assert int(one.num_accepted[0]) <= int(draft_len[b])


def test_theta_is_compared_in_float64():
    """float32(0.3) = 0.30000001 exceeds theta = 0.3; a float32 comparison rounds theta up to
    the same float and says it does not (hypothesis found this case)."""
    stat32 = torch.tensor([0.3], dtype=torch.float32)
    assert bool(relaxable(Rule(MARS, 0.3, PROB_RATIO), stat32)[0])
    assert bool(relaxable(Rule(MARS, 0.3, PROB_RATIO), stat32.double().numpy())[0])


def test_every_rule_has_one_behaviour_block():
    """A rule is its registry entry plus one RuleBehaviour block (rules.BEHAVIOURS)."""
    from marscli.verification.rules import BEHAVIOURS

    assert set(BEHAVIOURS) == set(RULEBOOK)
    for name, b in BEHAVIOURS.items():
        assert b.name == name and b.__doc__, name
        assert b.per_token == (name not in (STRICT, MARS)), name


def test_drafter_kinds_are_declared_once():
    from marscli.config import DraftConfig
    from marscli.drafters.kinds import DRAFTER_KINDS, DRAFTERS, EAGLE3, MODEL, NGRAM, NONE, PROFILE_KINDS, drafter_kind

    assert DRAFTER_KINDS == (NONE, NGRAM, MODEL, EAGLE3) and DraftConfig().kind == NGRAM
    assert PROFILE_KINDS == (NGRAM, MODEL, EAGLE3)
    assert [k for k, d in DRAFTERS.items() if d.model] == [MODEL, EAGLE3]
    assert [k for k, d in DRAFTERS.items() if d.trees] == [MODEL, EAGLE3]
    assert [k for k, d in DRAFTERS.items() if d.features] == [EAGLE3]
    with pytest.raises(ValueError, match="unknown drafter kind"):
        drafter_kind("self")
