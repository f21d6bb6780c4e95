"""The rulebook's seams: Rule, its per-position decision on torch and numpy alike, and the
batch-wide verification call (``verify_rows``: rows that decode differently in one call,
each row's verdicts what ``verify`` gives it alone, a sampled row's a function of its own
seed and position; the regret rule's carried sum; the verdicts' host layout), on random
logits over a 10-token vocabulary."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from marscli.config import SamplingParams, VerifyConfig
from marscli.verification.chain import NO_PROPOSAL, RowVerdict, VerifyResult, verify, verify_rows
from marscli.verification.registry import LOGIT_RATIO, MARS, PROB_RATIO, RATIO, REGRET, RULEBOOK, STRICT, Rule
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


def _random_step(B: int, K: int, seed: int):
    """A step of B rows: drafts mostly the argmax, sometimes the runner-up, sometimes anything;
    random draft lengths; a bonus proposal (or none) after each row's drafts; each row's record
    seed and output position."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, K + 1, V, generator=g) * 2
    argmax = logits.argmax(-1)
    runner_up = logits.scatter(-1, argmax.unsqueeze(-1), -math.inf).argmax(-1)
    pick = torch.randint(0, 3, (B, K + 1), generator=g)
    anything = torch.randint(0, V, (B, K + 1), generator=g)
    tokens = torch.where(pick == 0, argmax, torch.where(pick == 1, runner_up, anything))
    draft_len = torch.randint(0, K + 1, (B,), generator=g)
    bonus = tokens[torch.arange(B), draft_len]
    bonus = torch.where(torch.rand(B, generator=g) < 0.2, torch.full_like(bonus, NO_PROPOSAL), bonus)
    seeds = torch.randint(0, 2**40, (B,), generator=g)
    positions = torch.randint(0, 500, (B,), generator=g)
    return tokens[:, :K], logits, draft_len, bonus, seeds, positions


SETTINGS = [SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=3),
            SamplingParams(), SamplingParams(temperature=0.7), SamplingParams(temperature=1.2, top_p=0.8),
            SamplingParams(temperature=1.0, top_k=3)]


def _alone(drafts, logits, draft_len, rule, s: SamplingParams, b: int, **kw):
    """Row b verified on its own, with its own settings (its seed and position when sampled)."""
    one = {k: (None if v is None else v[b: b + 1]) for k, v in kw.items()}
    if s.greedy:
        one.pop("seeds", None)
        one.pop("positions", None)
    return verify(drafts[b: b + 1], logits[b: b + 1], rule=rule, temperature=s.temperature, top_k=s.top_k,
                  top_p=s.top_p, draft_len=draft_len[b: b + 1], **one)


@pytest.mark.parametrize("rule", [Rule(STRICT), Rule(MARS, 0.2, PROB_RATIO), Rule(MARS, 0.5, LOGIT_RATIO),
                                  Rule(RATIO, rho=0.5)], ids=lambda r: r.label())
def test_verify_rows_with_mixed_settings_equals_each_row_alone(rule):
    """verify_rows verifies rows that decode differently (greedy, tempered, filtered) in one
    call; every row's verdicts, read back on the host (RowVerdict: W = K + 1 positions, the
    statistic's float32 bits), are what ``verify`` gives that row alone, with the bonus, the
    guard and the relaxation budget."""
    B, K = 7, 4
    drafts, logits, draft_len, bonus, seeds, positions = _random_step(B, K, seed=11)
    g = torch.Generator().manual_seed(12)
    guard = torch.rand(B, K + 1, generator=g) < 0.15
    relax_left = torch.randint(1, 4, (B,), generator=g)
    kw = dict(bonus=bonus, seeds=seeds, positions=positions, guard=guard, relax_left=relax_left)
    res = verify_rows(drafts, logits, draft_len, rule, SETTINGS, **kw)
    rows = res.host_rows(statistic=True)
    assert res.relaxed.shape == res.strict_ok.shape == (B, K + 1)
    relaxed = 0
    for b, s in enumerate(SETTINGS):
        one = _alone(drafts, logits, draft_len, rule, s, b, **kw)
        assert rows[b].num_accepted == int(one.num_accepted[0]) and rows[b].next_token == int(one.next_token[0]), b
        assert rows[b].relaxed == one.relaxed[0].long().tolist()
        assert rows[b].relaxable == one.relaxable[0].long().tolist()
        assert rows[b].refused == (0 if one.refused is None else int(one.refused[0]))
        assert rows[b].statistic == one.statistic[0].tolist()  # float32 values, bit for bit
        assert torch.equal(res.strict_ok[b], one.strict_ok[0])
        assert int(one.num_accepted[0]) <= int(draft_len[b])
        relaxed += sum(rows[b].relaxed)
    # the relaxing rules do relax some rows here, and the guard or the budget refuses some
    assert rule.relaxes == (relaxed > 0) == any(r.refused for r in rows)


def test_verify_rows_without_guard_refuses_nothing():
    B, K = 7, 4
    drafts, logits, draft_len, bonus, seeds, positions = _random_step(B, K, seed=13)
    res = verify_rows(drafts, logits, draft_len, Rule(MARS, 0.2, PROB_RATIO), SETTINGS, bonus=bonus, seeds=seeds,
                      positions=positions)
    assert all(r.refused == 0 for r in res.host_rows())


def test_a_sampled_row_depends_on_its_own_seed_and_position_only():
    """A row's draws are a function of its seed and position: reordering the batch, or giving
    the other rows other seeds and positions, changes nothing for it; its own seed does."""
    B, K = 7, 4
    drafts, logits, draft_len, bonus, seeds, positions = _random_step(B, K, seed=17)
    rule = Rule(MARS, 0.5, LOGIT_RATIO)
    kw = dict(bonus=bonus, seeds=seeds, positions=positions)
    base = verify_rows(drafts, logits, draft_len, rule, SETTINGS, **kw).host_rows(statistic=True)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    shuffled = verify_rows(drafts[perm], logits[perm], draft_len[perm], rule, [SETTINGS[i] for i in perm],
                           **{k: v[perm] for k, v in kw.items()}).host_rows(statistic=True)
    for j, i in enumerate(perm.tolist()):
        assert shuffled[j] == base[i]
    others = dict(kw, seeds=seeds + 1_000, positions=positions + 7)
    for b in range(B):
        mixed = dict(others, seeds=others["seeds"].clone(), positions=others["positions"].clone())
        mixed["seeds"][b], mixed["positions"][b] = seeds[b], positions[b]
        assert verify_rows(drafts, logits, draft_len, rule, SETTINGS, **mixed).host_rows(statistic=True)[b] == base[b]
    # the sampled rows' own seeds do matter (their draws move), the greedy rows' never
    a = verify_rows(drafts, logits, draft_len, rule, SETTINGS, **kw)
    moved = verify_rows(drafts, logits, draft_len, rule, SETTINGS, **others)
    sampled = torch.tensor([not s.greedy for s in SETTINGS])
    assert not torch.equal(moved.strict_ok[sampled], a.strict_ok[sampled])
    assert torch.equal(moved.strict_ok[~sampled], a.strict_ok[~sampled])
    assert [moved.host_rows()[b] for b in range(B) if not sampled[b]] == [a.host_rows()[b] for b in range(B)
                                                                          if not sampled[b]]


def test_verify_rows_regret_carries_and_refuses_sampling():
    """The regret rule through verify_rows: each greedy row's carried sum goes in, the sum
    the next position starts from comes back (float64 bits through RowVerdict); a sampled row
    is refused."""
    B, K = 5, 3
    drafts, logits, draft_len, bonus, _, _ = _random_step(B, K, seed=19)
    rule = Rule(REGRET, budget=2.0)
    carry = torch.tensor([0.0, 0.5, 1.25, 1.9, 3.0], dtype=torch.float64)
    greedy = [SamplingParams()] * B
    res = verify_rows(drafts, logits, draft_len, rule, greedy, bonus=bonus, regret_carry=carry)
    rows = res.host_rows()
    for b in range(B):
        one = _alone(drafts, logits, draft_len, rule, greedy[b], b, bonus=bonus, regret_carry=carry)
        assert (rows[b].num_accepted, rows[b].next_token) == (int(one.num_accepted[0]), int(one.next_token[0]))
        assert rows[b].regret == float(one.regret[0]) == float(res.regret[b])
    assert any(r.regret > 0 for r in rows)  # some row kept the proposal after its drafts
    assert verify_rows(drafts, logits, draft_len, rule, greedy, bonus=bonus).regret is None
    with pytest.raises(ValueError, match="greedy"):
        verify_rows(drafts, logits, draft_len, rule, [SamplingParams(temperature=0.7)] + greedy[1:],
                    bonus=bonus, seeds=torch.zeros(B, dtype=torch.long), positions=torch.zeros(B, dtype=torch.long),
                    regret_carry=carry)


def test_row_verdicts_pack_and_unpack_by_name():
    """RowVerdict.pack lays a result out as [B, 3 + 2W (+ W) (+ 1) (+ X)] longs; unpack reads
    each field back: W = K + 1 positions, the statistic's float32 bits, the regret's float64
    bits, then the caller's extra columns."""
    W = 3
    res = VerifyResult(torch.tensor([2, 0]), torch.tensor([7, 4]),
                       torch.tensor([[True, False, True], [False, False, False]]),
                       torch.tensor([[True, True, True], [False, True, False]]),
                       torch.tensor([[0.3, -math.inf, 1.0], [0.1, 0.2, 0.30000001]]),
                       torch.tensor([False, True]), None, torch.tensor([2.5, 1e-300], dtype=torch.float64))
    extra = torch.tensor([[11, -12], [13, 14]])
    packed = RowVerdict.pack(res, statistic=True, extra=extra)
    assert packed.shape == (2, 3 + 2 * W + W + 1 + 2) and packed.dtype == torch.long
    rows = res.host_rows(statistic=True, extra=extra)
    assert rows[0] == RowVerdict(2, 7, [1, 0, 1], [1, 1, 1], 0, res.statistic[0].tolist(), [11, -12], 2.5)
    assert rows[1] == RowVerdict(0, 4, [0, 0, 0], [0, 1, 0], 1, res.statistic[1].tolist(), [13, 14], 1e-300)
    plain = RowVerdict.unpack(RowVerdict.pack(res).tolist()[1], W, regret=True)
    assert (plain.statistic, plain.regret, plain.extra) == (None, 1e-300, [])


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
