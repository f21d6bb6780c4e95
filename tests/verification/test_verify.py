"""Tests of marscli.verification.chain: margin statistics, strict/MARS greedy, sampling rules and their laws.

Hand-made logits over a 10-token vocabulary check every branch of the rules, at the K draft
positions and at the position after them (the bonus proposal); hypothesis checks the
vectorised functions against a per-row reference written straight from the rules (for
sampling, with its own plain-Python draw of each position from marscli.verification.draws'
noise); seeded distribution tests (many records at once, one seed each) check that strict
sampling emits exactly each position's draw whatever the drafts (drafter invariance) and so
reproduces the target law (chi-square), that deliberately broken draws fail the same check,
and that MARS sampling follows its own analytic per-position law.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import marscli.verification.chain as mv
from marscli.verification.chain import (
    NO_PROPOSAL,
    STRICT_RULE,
    VerifyResult,
    sample_from,
    sampled_draws,
    sampling_probs,
    verify,
)
from marscli.verification.draws import (
    CANDIDATE_RATIO,
    TAIL,
    TAIL_PICK,
    coupled_draw,
    position_keys,
    reference_uniform,
    uniforms,
)
from marscli.verification.registry import LOGIT_RATIO, MARS, PROB_RATIO, STRICT, Rule
from marscli.verification.rules import NOT_RELAXABLE, margin_statistic, top2
from tests.verify_helpers import mars_greedy, rule_from_theta, strict_greedy

V = 10
NINF = -math.inf
INF = math.inf

HYP = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

HYP_SLOW = settings(HYP, max_examples=100)


# ---------------------------------------- helpers


def row(spec: dict[int, float], fill: float = -10.0) -> list[float]:
    """One row of V logits: `fill` everywhere except the token ids given in spec."""
    out = [fill] * V
    for tok, z in spec.items():
        out[tok] = z
    return out


def logits_of(*rows: list[list[float]]) -> torch.Tensor:
    """logits_of(rows_of_batch_0, rows_of_batch_1, ...) -> [B, K+1, V] float32."""
    return torch.tensor(rows, dtype=torch.float32)


def argmax_row(tok: int) -> list[float]:
    return row({tok: 5.0})


def L(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def assert_same_result(a: VerifyResult, b: VerifyResult) -> None:
    assert torch.equal(a.num_accepted, b.num_accepted)
    assert torch.equal(a.next_token, b.next_token)
    assert torch.equal(a.relaxed, b.relaxed)
    assert torch.equal(a.relaxable, b.relaxable)
    assert torch.equal(a.statistic, b.statistic)
    assert torch.equal(a.strict_ok, b.strict_ok)


def result_row(r: VerifyResult, b: int) -> VerifyResult:
    s = slice(b, b + 1)
    return VerifyResult(
        r.num_accepted[s], r.next_token[s], r.relaxed[s], r.relaxable[s], r.statistic[s],
        strict_ok=r.strict_ok[s],
    )


def sample(drafts, lg: torch.Tensor, seeds, positions, *, rule: Rule = STRICT_RULE, temperature: float = 1.0,
           **kw) -> VerifyResult:
    """Sampled verification of one step: each row's record seed and the output position its
    logits row 0 judges."""
    return verify(torch.as_tensor(drafts, dtype=torch.long), lg, rule=rule, temperature=temperature,
                  seeds=L(list(seeds)), positions=L(list(positions)), **kw)


def chi_square(tokens: torch.Tensor, law: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of `tokens` against `law` [V] and its degrees of freedom (cells
    expecting fewer than 5 tokens pooled into one); a token outside the law's support gives
    +inf."""
    n = tokens.numel()
    assert n > 0
    cnt = torch.bincount(tokens, minlength=law.numel()).double()
    law = law.double()
    if bool((cnt[law <= 0] > 0).any()):
        return math.inf, 0
    exp = law * n
    big = exp >= 5
    obs = torch.cat([cnt[big], cnt[~big].sum().view(1)])
    want = torch.cat([exp[big], exp[~big].sum().view(1)])
    keep = want > 0
    chi = float(((obs[keep] - want[keep]) ** 2 / want[keep]).sum())
    return chi, int(keep.sum()) - 1


def fits(tokens: torch.Tensor, law: torch.Tensor) -> bool:
    """The tokens pass a chi-square test of `law` at about the 0.9999 level (seeded runs:
    the outcome is deterministic, the level only says how much slack an exact sampler has)."""
    chi, dof = chi_square(tokens, law)
    return chi < dof + 4.0 * math.sqrt(2.0 * dof) + 10.0


def tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance between the empirical law of `tokens` and p [V]."""
    assert tokens.numel() > 0
    freq = torch.bincount(tokens, minlength=p.numel()).double() / tokens.numel()
    return 0.5 * float((freq - p.double()).abs().sum())


def tv_bound(n: int, v: int = V) -> float:
    """A bound the TV of an exact sampler stays under, scaling like sqrt(V/N).

    E[TV] <= 0.5 * sqrt(V/N) (Cauchy-Schwarz on sum_i E|freq_i - p_i|), and TV moves by at most
    1/N per sample, so by McDiarmid P(TV > E[TV] + sqrt(V/N)) <= exp(-2V) = 2e-9 for V = 10.
    """
    return 1.5 * math.sqrt(v / n)


def token_at(
    res: VerifyResult, drafts: torch.Tensor, pos: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token emitted at step position pos, mask of rows whose step reached that position)."""
    n = res.num_accepted
    K = drafts.shape[1]
    reached = n >= pos
    if pos < K:
        tok = torch.where(n > pos, drafts[:, pos], res.next_token)
    else:
        tok = res.next_token
    return tok[reached], reached


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------- top2


def test_top2_values_and_ids():
    lg = torch.tensor([row({1: 5.0, 2: 3.0, 7: 2.5}, fill=0.0)])
    z1, z2, t1, t2 = top2(lg)
    assert (float(z1), float(z2), int(t1), int(t2)) == (5.0, 3.0, 1, 2)
    assert z1.shape == z2.shape == t1.shape == t2.shape == (1,)


def test_top2_ties_resolve_to_lowest_ids():
    # three-way tie for the max: top-1 is the lowest id, top-2 the next lowest
    lg = torch.tensor(row({7: 4.0, 3: 4.0, 5: 4.0}, fill=0.0))
    z1, z2, t1, t2 = top2(lg)
    assert (int(t1), int(t2)) == (3, 5)
    assert float(z1) == float(z2) == 4.0
    # same as torch.argmax (transformers' greedy choice)
    assert int(t1) == int(lg.argmax())
    # tie only for second place
    z1, z2, t1, t2 = top2(torch.tensor(row({8: 9.0, 6: 2.0, 4: 2.0}, fill=0.0)))
    assert (int(t1), int(t2), float(z2)) == (8, 4, 2.0)


def test_top2_with_neg_inf_entries():
    lg = torch.tensor(row({2: 1.0, 9: 0.5}, fill=NINF))
    z1, z2, t1, t2 = top2(lg)
    assert (int(t1), int(t2), float(z1), float(z2)) == (2, 9, 1.0, 0.5)
    # a single finite logit: the top-2 logit is -inf
    z1, z2, t1, _ = top2(torch.tensor(row({4: 1.0}, fill=NINF)))
    assert (int(t1), float(z1), float(z2)) == (4, 1.0, NINF)


def test_top2_reads_float32_from_low_precision_logits():
    lg = torch.tensor([row({1: 3.0, 2: 2.0}, fill=0.0)], dtype=torch.bfloat16)
    z1, z2, _, _ = top2(lg)
    assert z1.dtype == z2.dtype == torch.float32


# ---------------------------------------- margin statistic


def never_relaxable(stat: float) -> bool:
    """A statistic no theta relaxes: NOT_RELAXABLE (-inf)."""
    return stat == NOT_RELAXABLE


def test_logit_ratio_values():
    z1 = torch.tensor([4.0, 2.0, 5.0, 3.0, 2.0, -1.0, 0.0, -0.5])
    z2 = torch.tensor([3.0, -1.0, 5.0, 0.0, NINF, -2.0, -0.1, -0.5])
    stat = margin_statistic(z1, z2, LOGIT_RATIO)
    assert stat.dtype == torch.float32
    assert stat[:4].tolist() == pytest.approx([0.75, -0.5, 1.0, 0.0])
    assert all(never_relaxable(s) for s in stat[4:].tolist())
    for theta in (-1e30, -10.0, 0.0, 0.9):
        assert not (stat[4:] > theta).any()


def test_not_relaxable_statistic_is_minus_inf():
    # z1 <= 0, and z2 = -inf under z1 > 0: the statistic is exactly NOT_RELAXABLE
    z1 = torch.tensor([-1.0, 0.0, 2.0])
    z2 = torch.tensor([-2.0, -0.1, NINF])
    assert margin_statistic(z1, z2, LOGIT_RATIO).tolist() == [NOT_RELAXABLE] * 3


def test_z1_non_positive_never_relaxable_even_at_theta_minus_inf():
    # "logit-ratio positions with z1 <= 0 never relaxable": got relaxed acceptance of token 3
    lg = logits_of([row({2: -1.0, 3: -1.05}, fill=-20.0), argmax_row(8)])
    r = mars_greedy(L([[3]]), lg, theta=NINF, margin=LOGIT_RATIO)
    assert r.relaxable.tolist() == [[False, False]]
    assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [2])


def test_neg_inf_logit_draft_never_accepted_at_theta_minus_inf():
    # one finite logit (z2 = -inf): got draft 0, whose logit is -inf, accepted as "relaxed"
    lg = logits_of([row({2: 2.0}, fill=NINF), argmax_row(8)])
    r = mars_greedy(L([[0]]), lg, theta=NINF, margin=LOGIT_RATIO)
    assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [2])


def test_prob_ratio_values():
    z1 = torch.tensor([4.0, -1.0, 0.0, 3.0, 2.0, NINF, -7.0])
    z2 = torch.tensor([3.0, -2.0, -0.1, 3.0, NINF, NINF, -7.0])
    stat = margin_statistic(z1, z2, PROB_RATIO)
    expected = [math.exp(-1), math.exp(-1), math.exp(-0.1), 1.0, 0.0, 0.0, 1.0]
    assert stat.tolist() == pytest.approx(expected, rel=1e-6)
    assert stat.dtype == torch.float32


def test_prob_ratio_is_shift_invariant_and_logit_ratio_is_not():
    base = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0, 0.5, 0.25, -2.0, 1.5, 2.0]])
    for c in (-8.0, -3.0, 0.0, 4.0):
        z1, z2, _, _ = top2(base + c)
        assert float(margin_statistic(z1, z2, PROB_RATIO)) == pytest.approx(math.exp(-0.5))
    z1, z2, _, _ = top2(base + 4.0)
    assert float(margin_statistic(z1, z2, LOGIT_RATIO)) == pytest.approx(6.5 / 7.0)
    z1, z2, _, _ = top2(base - 3.0)  # z1 = 0: the logit ratio has no meaning
    assert never_relaxable(float(margin_statistic(z1, z2, LOGIT_RATIO)))


def test_margin_statistic_rejects_unknown_margin():
    with pytest.raises(ValueError, match="unknown margin"):
        margin_statistic(torch.tensor([1.0]), torch.tensor([0.5]), "entropy")


# ---------------------------------------- greedy branches


def test_strict_greedy_all_accepted_then_bonus():
    drafts = L([[2, 5, 7]])
    lg = logits_of([argmax_row(2), argmax_row(5), argmax_row(7), argmax_row(4)])
    r = strict_greedy(drafts, lg)
    assert r.num_accepted.tolist() == [3]
    assert r.next_token.tolist() == [4]  # bonus: argmax of row K
    assert r.emitted(drafts, 0) == [2, 5, 7, 4]
    assert not r.relaxed.any() and not r.relaxable.any()
    # per-position outputs cover the K drafts and the position after them (no proposal there)
    assert r.relaxed.shape == r.relaxable.shape == r.statistic.shape == r.strict_ok.shape == (1, 4)
    assert r.strict_ok.tolist() == [[True, True, True, False]]
    assert r.statistic.tolist() == [[NOT_RELAXABLE] * 4]  # strict computes no statistic
    assert r.num_accepted.dtype == r.next_token.dtype == torch.long


@pytest.mark.parametrize(
    ("drafts", "n", "nxt"),
    [([6, 5, 7], 0, 2), ([2, 6, 7], 1, 5), ([2, 5, 8], 2, 7)],
)
def test_strict_greedy_first_rejection_emits_correction(drafts, n, nxt):
    lg = logits_of([argmax_row(2), argmax_row(5), argmax_row(7), argmax_row(4)])
    r = strict_greedy(L([drafts]), lg)
    assert r.num_accepted.tolist() == [n]
    assert r.next_token.tolist() == [nxt]  # correction: argmax at the rejected position
    assert r.emitted(L([drafts]), 0) == drafts[:n] + [nxt]


def test_strict_greedy_stops_at_first_rejection_even_if_later_drafts_match():
    lg = logits_of([argmax_row(2), argmax_row(5), argmax_row(7), argmax_row(4)])
    r = strict_greedy(L([[2, 0, 7]]), lg)
    assert r.num_accepted.tolist() == [1] and r.next_token.tolist() == [5]


def close_call(t1: int, t2: int, z1: float = 4.0, ratio: float = 0.9, t3: int | None = None):
    """A row whose top-1/top-2 are t1/t2 with z2 = ratio * z1 (and an optional third token)."""
    spec = {t1: z1, t2: ratio * z1}
    if t3 is not None:
        spec[t3] = ratio * z1 * 0.5
    return row(spec, fill=-10.0)


def test_mars_greedy_relaxed_acceptance_of_top2():
    drafts = L([[3, 5]])
    lg = logits_of([close_call(2, 3, ratio=0.9), argmax_row(5), argmax_row(8)])
    r = mars_greedy(drafts, lg, theta=0.8)
    assert r.num_accepted.tolist() == [2]
    assert r.next_token.tolist() == [8]  # bonus
    # W = K + 1 positions; the last has no proposal (no bonus given): never relaxed
    assert r.relaxed.tolist() == [[True, False, False]]
    # rows 1 and 2: z1 = 5, z2 = -10 -> ratio -2, not relaxable
    assert r.relaxable.tolist() == [[True, False, False]]
    # the statistic is reported at every position, the one after the drafts included
    assert r.statistic[0].tolist() == pytest.approx([0.9, -2.0, -2.0])
    assert r.strict_ok.tolist() == [[False, True, False]]
    # strict rejects the same draft and emits the top-1
    s = strict_greedy(drafts, lg)
    assert (s.num_accepted.tolist(), s.next_token.tolist()) == ([0], [2])


def test_mars_greedy_top2_at_non_relaxable_position_is_rejected():
    drafts = L([[3, 5]])
    lg = logits_of([close_call(2, 3, ratio=0.5), argmax_row(5), argmax_row(8)])
    r = mars_greedy(drafts, lg, theta=0.8)
    assert r.num_accepted.tolist() == [0]
    assert r.next_token.tolist() == [2]
    assert r.relaxable.tolist() == [[False, False, False]]
    assert not r.relaxed.any()
    assert float(r.statistic[0, 0]) == pytest.approx(0.5)


def test_mars_greedy_threshold_is_strict_inequality():
    lg = logits_of([close_call(2, 3, z1=4.0, ratio=0.5), argmax_row(8)])
    assert mars_greedy(L([[3]]), lg, theta=0.5).num_accepted.tolist() == [0]
    assert mars_greedy(L([[3]]), lg, theta=0.4999).num_accepted.tolist() == [1]


def test_mars_greedy_top3_rejected_even_when_relaxable():
    drafts = L([[6]])
    lg = logits_of([close_call(2, 3, ratio=0.95, t3=6), argmax_row(8)])
    r = mars_greedy(drafts, lg, theta=0.1)
    assert r.relaxable.tolist() == [[True, False]]
    assert r.num_accepted.tolist() == [0]
    assert r.next_token.tolist() == [2]
    assert not r.relaxed.any()


def test_mars_greedy_top1_accepted_and_not_marked_relaxed():
    drafts = L([[2, 4]])
    lg = logits_of([close_call(2, 3, ratio=0.9), close_call(4, 1, ratio=0.95), argmax_row(0)])
    r = mars_greedy(drafts, lg, theta=0.5)
    assert r.num_accepted.tolist() == [2] and r.next_token.tolist() == [0]
    assert r.relaxable.tolist() == [[True, True, False]]
    assert r.relaxed.tolist() == [[False, False, False]]


def test_mars_greedy_relaxed_then_correction_after_later_rejection():
    drafts = L([[3, 9, 1]])
    lg = logits_of(
        [close_call(2, 3, ratio=0.9), close_call(4, 5, ratio=0.9), argmax_row(1), argmax_row(0)]
    )
    r = mars_greedy(drafts, lg, theta=0.8)
    assert r.num_accepted.tolist() == [1]
    assert r.next_token.tolist() == [4]
    # relaxed marks accepted drafts only; relaxable is a property of the position
    assert r.relaxed.tolist() == [[True, False, False, False]]
    assert r.relaxable.tolist() == [[True, True, False, False]]


@pytest.mark.parametrize(("z1", "z2"), [(-1.0, -1.05), (0.0, -0.05), (-3.0, -3.0)])
def test_non_positive_top1_never_relaxable_under_logit_ratio(z1, z2):
    # the raw ratio z2 / z1 would be >= 1 (or undefined) here, yet the position is not relaxable
    lg = logits_of([row({2: z1, 3: z2}, fill=-20.0), argmax_row(8)])
    drafts = L([[3]])
    for theta in (-5.0, 0.0, 0.9):
        r = mars_greedy(drafts, lg, theta=theta, margin=LOGIT_RATIO)
        assert never_relaxable(float(r.statistic[0, 0]))
        assert r.relaxable.tolist() == [[False, False]]
        assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [2])
    # the same position is relaxable under prob-ratio: exp(z2 - z1) >= exp(-0.05) > 0.9
    r = mars_greedy(drafts, lg, theta=0.9, margin=PROB_RATIO)
    assert float(r.statistic[0, 0]) == pytest.approx(math.exp(z2 - z1))
    assert r.relaxable.tolist() == [[True, False]]
    assert r.relaxed.tolist() == [[True, False]]
    assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([1], [8])


def test_logit_ratio_small_positive_top1_with_negative_top2():
    # z1 > 0, z2 < 0: the ratio is negative; a negative theta can relax it (paper's formula)
    lg = logits_of([row({2: 2.0, 3: -1.0}, fill=-20.0), argmax_row(8)])
    r = mars_greedy(L([[3]]), lg, theta=-0.6)
    assert float(r.statistic[0, 0]) == pytest.approx(-0.5)
    assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[True, False]]
    assert mars_greedy(L([[3]]), lg, theta=-0.4).num_accepted.tolist() == [0]


def test_ties_top1_lowest_id_and_ratio_one():
    # z1 == z2 at tokens 4 and 7: top-1 is 4, top-2 is 7, r = 1
    lg = logits_of([row({7: 3.0, 4: 3.0}, fill=-5.0), argmax_row(8)])
    s = strict_greedy(L([[7]]), lg)
    assert (s.num_accepted.tolist(), s.next_token.tolist()) == ([0], [4])
    s = strict_greedy(L([[4]]), lg)
    assert (s.num_accepted.tolist(), s.next_token.tolist()) == ([1], [8])
    for margin in (LOGIT_RATIO, PROB_RATIO):
        r = mars_greedy(L([[7]]), lg, theta=0.99, margin=margin)
        assert float(r.statistic[0, 0]) == 1.0
        assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([1], [8])
        assert r.relaxed.tolist() == [[True, False]]
        # theta = 1: 1 > 1 is false -> strict
        r = mars_greedy(L([[7]]), lg, theta=1.0, margin=margin)
        assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [4])
        # exact top-1 is accepted and never relaxed
        r = mars_greedy(L([[4]]), lg, theta=0.99, margin=margin)
        assert r.num_accepted.tolist() == [1] and not r.relaxed.any()


def test_three_way_tie_third_token_not_top2():
    lg = logits_of([row({6: 2.0, 1: 2.0, 9: 2.0}, fill=-5.0), argmax_row(8)])
    # top-1 = 1, top-2 = 6; 9 is the third although its logit is equal
    assert mars_greedy(L([[6]]), lg, theta=0.5).num_accepted.tolist() == [1]
    r = mars_greedy(L([[9]]), lg, theta=0.5)
    assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [1])


def test_neg_inf_top2_never_relaxable():
    # top-k/top-p style filtering leaves one finite logit: z2 = -inf
    lg = logits_of([row({4: 2.0}, fill=NINF), argmax_row(8)])
    for draft in range(V):
        if draft == 4:
            continue
        for margin, theta in ((LOGIT_RATIO, -100.0), (PROB_RATIO, 0.0)):
            r = mars_greedy(L([[draft]]), lg, theta=theta, margin=margin)
            stat = float(r.statistic[0, 0])
            assert never_relaxable(stat) if margin == LOGIT_RATIO else stat == 0.0
            assert r.relaxable.tolist() == [[False, False]]
            assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [4])


def test_neg_inf_below_top2_does_not_matter():
    lg = logits_of([row({2: 3.0, 5: 2.9}, fill=NINF), argmax_row(8)])
    r = mars_greedy(L([[5]]), lg, theta=0.9)
    assert float(r.statistic[0, 0]) == pytest.approx(2.9 / 3.0)
    assert r.num_accepted.tolist() == [1]
    r = mars_greedy(L([[5]]), lg, theta=0.5, margin=PROB_RATIO)
    assert float(r.statistic[0, 0]) == pytest.approx(math.exp(-0.1), rel=1e-5)
    assert r.num_accepted.tolist() == [1]


def test_draft_len_padding_greedy():
    # every draft (padding included) equals the argmax, so only draft_len stops acceptance
    B, K = 3, 4
    tops = [1, 2, 3, 4, 5]
    lg = torch.tensor([[argmax_row(t) for t in tops]] * B)
    drafts = L([tops[:K]] * B)
    dl = L([4, 2, 0])
    for r in (
        strict_greedy(drafts, lg, dl),
        mars_greedy(drafts, lg, theta=0.1, draft_len=dl),
        verify(drafts, lg, rule=rule_from_theta(INF), draft_len=dl),
    ):
        assert r.num_accepted.tolist() == [4, 2, 0]
        # bonus: argmax of the row after the last real draft
        assert r.next_token.tolist() == [5, 3, 1]
        assert r.emitted(drafts, 1) == [1, 2, 3]
        assert r.emitted(drafts, 2) == [1]


def test_draft_len_padding_never_relaxed_nor_relaxable():
    # every position is a close call and every draft is its top-2
    K = 3
    lg = logits_of([close_call(2, 3, ratio=0.9)] * K + [argmax_row(8)])
    lg = lg.expand(3, -1, -1).contiguous()
    drafts = L([[3, 3, 3]] * 3)
    r = mars_greedy(drafts, lg, theta=0.5, draft_len=L([3, 1, 0]))
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert r.next_token.tolist() == [8, 2, 2]
    # the position after a row's drafts has no proposal (no bonus given): not relaxable
    assert r.relaxable.tolist() == [[True] * 3 + [False], [True] + [False] * 3, [False] * 4]
    assert r.relaxed.tolist() == [[True] * 3 + [False], [True] + [False] * 3, [False] * 4]
    # the statistic is reported for every position, padded or not
    assert r.statistic.flatten().tolist() == pytest.approx([0.9, 0.9, 0.9, -2.0] * 3)


def test_draft_len_padding_with_a_bonus_judges_only_the_position_after_the_drafts():
    """Every position is a close call and every draft (padding too) and the bonus are its
    top-2: the bonus is judged at position draft_len[b] and relaxed there; the padding after
    it is never relaxable nor relaxed."""
    K = 3
    lg = logits_of([close_call(2, 3, ratio=0.9)] * (K + 1)).expand(3, -1, -1).contiguous()
    drafts = L([[3, 3, 3]] * 3)
    r = verify(drafts, lg, rule=rule_from_theta(0.5), draft_len=L([3, 1, 0]), bonus=L([3, 3, 3]))
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert r.next_token.tolist() == [3, 3, 3]  # the bonus proposal, kept
    assert r.relaxable.tolist() == [[True] * 4, [True, True, False, False], [True, False, False, False]]
    assert r.relaxed.tolist() == r.relaxable.tolist()
    # strict: the same bonus proposal is replaced by the target's top-1
    s = verify(drafts, lg, rule=rule_from_theta(INF), draft_len=L([3, 1, 0]), bonus=L([3, 3, 3]))
    assert s.num_accepted.tolist() == [0, 0, 0] and s.next_token.tolist() == [2, 2, 2]
    s = verify(L([[2, 2, 2]] * 3), lg, rule=rule_from_theta(INF), draft_len=L([3, 1, 0]), bonus=L([3, 3, 3]))
    assert s.num_accepted.tolist() == [3, 1, 0] and s.next_token.tolist() == [2, 2, 2]
    assert not s.relaxed.any() and not s.relaxable.any()


def test_batched_greedy_rows_independent():
    rows = [
        [close_call(2, 3, ratio=0.9), argmax_row(5), argmax_row(6), argmax_row(7), argmax_row(1)],
        [argmax_row(0), close_call(4, 1, ratio=0.3), argmax_row(6), argmax_row(7), argmax_row(9)],
        [row({5: -1.0, 6: -1.01}), argmax_row(6), argmax_row(6), argmax_row(7), argmax_row(2)],
    ]
    lg = torch.tensor(rows)
    drafts = L([[3, 5, 6, 0], [0, 1, 6, 7], [6, 6, 6, 7]])
    dl = L([4, 4, 3])
    for margin in (LOGIT_RATIO, PROB_RATIO):
        for theta in (0.5, INF):
            batched = mars_greedy(drafts, lg, theta, margin, dl)
            for b in range(3):
                alone = mars_greedy(drafts[b : b + 1], lg[b : b + 1], theta, margin, dl[b : b + 1])
                assert_same_result(result_row(batched, b), alone)
    batched = strict_greedy(drafts, lg, dl)
    for b in range(3):
        alone = strict_greedy(drafts[b : b + 1], lg[b : b + 1], dl[b : b + 1])
        assert_same_result(result_row(batched, b), alone)
    r = mars_greedy(drafts, lg, 0.5, LOGIT_RATIO, dl)
    assert r.num_accepted.tolist() == [3, 1, 0]
    assert r.next_token.tolist() == [7, 4, 5]
    # VerifyResult.row: one row's result cut to its k drafts and the position after them
    for b in range(3):
        k = int(dl[b])
        cut = r.row(b, k)
        assert cut.relaxed.shape == cut.relaxable.shape == cut.statistic.shape == cut.strict_ok.shape == (1, k + 1)
        assert torch.equal(cut.relaxed, r.relaxed[b: b + 1, : k + 1])
        assert torch.equal(cut.statistic, r.statistic[b: b + 1, : k + 1])
        assert (cut.num_accepted.tolist(), cut.next_token.tolist()) == ([r.num_accepted[b].item()],
                                                                       [r.next_token[b].item()])
    r = mars_greedy(drafts, lg, 0.5, PROB_RATIO, dl)
    assert r.num_accepted.tolist() == [3, 1, 3]
    assert r.next_token.tolist() == [7, 4, 7]  # row 2: relaxed at 0 (exp(-0.01)), then bonus


def test_theta_inf_mars_equals_strict_on_close_calls():
    lg = logits_of([close_call(2, 3, ratio=0.999), row({4: 1.0, 5: 1.0}), argmax_row(8)])
    drafts = L([[3, 5]])
    s = strict_greedy(drafts, lg)
    for margin in (LOGIT_RATIO, PROB_RATIO):
        r = mars_greedy(drafts, lg, INF, margin)
        assert torch.equal(r.num_accepted, s.num_accepted)
        assert torch.equal(r.next_token, s.next_token)
        assert not r.relaxed.any() and not r.relaxable.any()


def test_verify_dispatch_greedy():
    lg = logits_of([close_call(2, 3, ratio=0.9), argmax_row(8)])
    r = verify(L([[3]]), lg, rule=rule_from_theta(INF))
    assert r.num_accepted.tolist() == [0]
    assert r.statistic.tolist() == [[NOT_RELAXABLE] * 2]  # strict_greedy computes no statistic
    r = verify(L([[3]]), lg, rule=rule_from_theta(0.5, PROB_RATIO))
    assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[True, False]]


def test_zero_drafts_emit_target_token():
    lg = logits_of([argmax_row(6)])
    drafts = torch.zeros(1, 0, dtype=torch.long)
    for r in (strict_greedy(drafts, lg), mars_greedy(drafts, lg, 0.5)):
        assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [6]
        assert r.relaxed.shape == (1, 1) and not r.relaxed.any()
    for seed in range(20):
        r = sample(drafts, lg, [seed], [3], top_k=1)
        assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [6]


# ---------------------------------------- greedy properties

# a coarse grid makes ties and z1 <= 0 common; a few continuous values and -inf mixed in
grid_logit = st.sampled_from([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
any_logit = st.one_of(grid_logit, grid_logit, grid_logit, st.floats(-6, 6, width=32), st.just(NINF))
GREEDY_THETAS = [-0.5, 0.0, 0.3, 0.5, 0.7, 0.9, 1.0, INF]


def biased_tokens(draw, rows: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Tokens of `shape` (one per row of `rows` [..., V]), biased towards the rows' top-1 and
    top-2 so that acceptance is common."""
    n = math.prod(shape)
    _, _, t1, t2 = top2(rows) if n else (None, None, torch.zeros(shape, dtype=torch.long),
                                        torch.zeros(shape, dtype=torch.long))
    c = torch.tensor(draw(st.lists(st.integers(0, V + 1), min_size=n, max_size=n)), dtype=torch.long)
    c = c.reshape(shape)
    return torch.where(c == V, t1, torch.where(c == V + 1, t2, c.clamp(max=V - 1)))


@st.composite
def greedy_case(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(0, 4))
    lg = draw(st.lists(st.lists(st.lists(any_logit, min_size=V, max_size=V), min_size=K + 1,
                                max_size=K + 1), min_size=B, max_size=B))
    lg = torch.tensor(lg, dtype=torch.float32)
    drafts = biased_tokens(draw, lg[:, :K], (B, K))
    dl = L(draw(st.lists(st.integers(0, K), min_size=B, max_size=B)))
    use_dl = draw(st.booleans())
    bonus = None
    if draw(st.booleans()):  # a proposal for the position after each row's drafts, or none
        at = dl if use_dl else torch.full((B,), K)
        bonus = biased_tokens(draw, lg[torch.arange(B), at], (B,))
        none = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
        bonus = torch.where(none, torch.full_like(bonus, NO_PROPOSAL), bonus)
    return drafts, lg, (dl if use_dl else None), bonus


def ref_top2(z: list[float]) -> tuple[int, int, float, float]:
    t1 = max(range(V), key=lambda i: (z[i], -i))
    rest = [i for i in range(V) if i != t1]
    t2 = max(rest, key=lambda i: (z[i], -i))
    return t1, t2, z[t1], z[t2]


def ref_stat(z1: float, z2: float, margin: str) -> float:
    a = torch.tensor(z1, dtype=torch.float32)
    b = torch.tensor(z2, dtype=torch.float32)
    if margin == LOGIT_RATIO:
        return float(b / a) if z1 > 0 else NOT_RELAXABLE
    return float(torch.exp(b - a)) if math.isfinite(z1) else 0.0


def ref_mars_greedy_row(drafts, lg, theta, margin, n_real, bonus=NO_PROPOSAL):
    """Algorithm 1 for one row, straight from the rules (lists in, (n, next, relaxed) out),
    with the bonus proposal judged by the same rule at the position after the drafts."""
    relaxed = [False] * (len(drafts) + 1)
    for i in range(n_real + 1):
        x = drafts[i] if i < n_real else bonus
        t1, t2, z1, z2 = ref_top2(lg[i])
        if x == NO_PROPOSAL:  # nothing proposed there: the target's own token
            return i, t1, relaxed
        if x == t1:
            kept = x
        elif x == t2 and ref_stat(z1, z2, margin) > theta and lg[i][x] > NINF:
            relaxed[i] = True
            kept = x
        else:
            return i, t1, relaxed
        if i == n_real:  # the bonus proposal, kept
            return n_real, kept, relaxed
    raise AssertionError("unreachable")


@HYP
@given(greedy_case(), st.sampled_from(GREEDY_THETAS), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_mars_greedy_matches_reference(case, theta, margin):
    drafts, lg, dl, bonus = case
    if margin == PROB_RATIO and theta < 0:
        theta = 0.0  # stat = 0 at z2 = -inf: theta < 0 would relax a row's -inf top-2 token
    B, K = drafts.shape
    r = verify(drafts, lg, rule=rule_from_theta(theta, margin), draft_len=dl, bonus=bonus)
    assert r.relaxed.shape == r.relaxable.shape == r.statistic.shape == r.strict_ok.shape == (B, K + 1)
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        bx = NO_PROPOSAL if bonus is None else int(bonus[b])
        n, nxt, relaxed = ref_mars_greedy_row(drafts[b].tolist(), lg[b].tolist(), theta, margin, n_real, bx)
        assert int(r.num_accepted[b]) == n
        assert int(r.next_token[b]) == nxt
        assert r.relaxed[b].tolist() == relaxed
        for i in range(K + 1):
            z1, z2 = ref_top2(lg[b, i].tolist())[2:]
            stat = ref_stat(z1, z2, margin)
            got = float(r.statistic[b, i])
            if math.isinf(theta):  # strict: no statistic computed
                assert never_relaxable(got)
            elif stat == NOT_RELAXABLE:
                assert never_relaxable(got)
            else:
                assert got == pytest.approx(stat, rel=1e-6)
            proposed = i < n_real or (i == n_real and bx != NO_PROPOSAL)
            assert bool(r.relaxable[b, i]) == (stat > theta and proposed)
            x = int(drafts[b, i]) if i < n_real else bx
            assert bool(r.strict_ok[b, i]) == (proposed and x == ref_top2(lg[b, i].tolist())[0])


@HYP
@given(greedy_case(), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_theta_inf_mars_greedy_is_strict(case, margin):
    drafts, lg, dl, bonus = case
    s = verify(drafts, lg, rule=rule_from_theta(INF), draft_len=dl, bonus=bonus)
    r = verify(drafts, lg, rule=Rule(MARS, INF, margin), draft_len=dl, bonus=bonus)
    assert torch.equal(r.num_accepted, s.num_accepted)
    assert torch.equal(r.next_token, s.next_token)
    assert torch.equal(r.relaxed, s.relaxed) and not r.relaxed.any()
    assert torch.equal(r.relaxable, s.relaxable) and not r.relaxable.any()
    # strict greedy = transformers' argmax rule, whatever the bonus proposal
    B, K = drafts.shape
    am = lg.argmax(-1)
    plain = strict_greedy(drafts, lg, dl)
    assert torch.equal(plain.num_accepted, s.num_accepted) and torch.equal(plain.next_token, s.next_token)
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        n = 0
        while n < n_real and int(drafts[b, n]) == int(am[b, n]):
            n += 1
        assert int(s.num_accepted[b]) == n and int(s.next_token[b]) == int(am[b, n])


@HYP
@given(greedy_case(), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_mars_greedy_monotone_in_theta_and_rows_independent(case, margin):
    drafts, lg, dl, bonus = case
    prev = None
    for theta in (INF, 0.9, 0.5, 0.0):
        r = verify(drafts, lg, rule=rule_from_theta(theta, margin), draft_len=dl, bonus=bonus)
        if prev is not None:
            assert (r.num_accepted >= prev.num_accepted).all()  # a lower threshold never accepts less
        prev = r
    r = verify(drafts, lg, rule=rule_from_theta(0.5, margin), draft_len=dl, bonus=bonus)
    for b in range(drafts.shape[0]):
        alone = verify(drafts[b: b + 1], lg[b: b + 1], rule=rule_from_theta(0.5, margin),
                       draft_len=None if dl is None else dl[b: b + 1],
                       bonus=None if bonus is None else bonus[b: b + 1])
        assert_same_result(result_row(r, b), alone)


# ---------------------------------------- sampling_probs


def test_sampling_probs_temperature():
    lg = torch.randn(3, V, generator=gen(0)) * 2
    for t in (0.25, 1.0, 3.0):
        p = sampling_probs(lg, t)
        assert p.dtype == torch.float32
        assert torch.allclose(p, torch.softmax(lg / t, dim=-1), atol=1e-7)
        assert torch.allclose(p.sum(-1), torch.ones(3))
    # float16 logits give float32 probabilities
    assert sampling_probs(lg.half(), 1.0).dtype == torch.float32
    with pytest.raises(AssertionError, match="temperature"):
        sampling_probs(lg, 0.0)


def test_top_k_keeps_ties_at_the_boundary():
    lg = torch.tensor(row({0: 5.0, 1: 4.0, 2: 4.0, 3: 4.0, 4: 1.0}, fill=0.0))
    p = sampling_probs(lg, 1.0, top_k=2)
    assert (p > 0).nonzero().flatten().tolist() == [0, 1, 2, 3]
    expected = torch.softmax(torch.tensor([5.0, 4.0, 4.0, 4.0]), -1)
    assert torch.allclose(p[:4], expected) and p[4:].sum() == 0
    # no boundary tie: exactly k
    p = sampling_probs(lg, 1.0, top_k=1)
    assert p.tolist() == [1.0] + [0.0] * 9
    # k >= V or k = 0: no filtering
    for k in (0, V, V + 5):
        assert torch.allclose(sampling_probs(lg, 1.0, top_k=k), torch.softmax(lg, -1))


def test_top_p_matches_hand_computation():
    probs = [0.35, 0.25, 0.15, 0.10, 0.05, 0.04, 0.03, 0.02, 0.005, 0.005]
    perm = [3, 7, 0, 9, 1, 5, 2, 8, 6, 4]  # scatter them so that order != token id
    lg = torch.empty(V)
    for pr, tok in zip(probs, perm):
        lg[tok] = math.log(pr)
    # ascending tail masses: .005 .01 .03 .06 .10 .15 .25 | .40 ... -> drop while <= 0.3
    p = sampling_probs(lg, 1.0, top_p=0.7)
    kept = sorted(perm[:3])
    assert (p > 0).nonzero().flatten().tolist() == kept
    for pr, tok in zip(probs[:3], perm[:3]):
        assert float(p[tok]) == pytest.approx(pr / 0.75, rel=1e-5)
    # top_p = 0.91: tail <= 0.09 dropped: .005 .005 .02 .03 (mass .06); with .04 it is .10
    p = sampling_probs(lg, 1.0, top_p=0.91)
    assert (p > 0).nonzero().flatten().tolist() == sorted(perm[:6])
    assert float(p[perm[5]]) == pytest.approx(0.04 / 0.94, rel=1e-5)
    assert float(p.sum()) == pytest.approx(1.0)


def test_top_p_keeps_at_least_one_token():
    lg = torch.tensor(row({6: 8.0, 2: 1.0}, fill=0.0))  # p(6) ~ 0.99
    for top_p in (1e-6, 0.1, 0.5, 0.9):
        p = sampling_probs(lg, 1.0, top_p=top_p)
        assert p.argmax().item() == 6 and float(p[6]) == 1.0
    p = sampling_probs(lg, 1.0, top_p=0.0)
    assert (p > 0).sum() == 1 and float(p[6]) == 1.0
    # with -inf entries (already filtered) as well
    lg = torch.tensor(row({3: 0.0}, fill=NINF))
    assert sampling_probs(lg, 0.7, top_k=3, top_p=0.2).tolist() == [0.0] * 3 + [1.0] + [0.0] * 6


def test_top_k_then_top_p_order():
    # top-p acts on the top-k-renormalised distribution (transformers' order)
    lg = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * 6) + 1e-12)
    # after top-2: (4/7, 3/7); top_p = 0.5 drops 3/7 (<= 0.5)
    p = sampling_probs(lg, 1.0, top_k=2, top_p=0.5)
    assert (p > 0).nonzero().flatten().tolist() == [0]
    # without top-k the tail below 0.5 is {0.1, 0.2}: {0, 1} kept
    p = sampling_probs(lg, 1.0, top_p=0.5)
    assert (p > 0).nonzero().flatten().tolist() == [0, 1]


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 5, 0.9), (2.0, 2, 0.3), (1.0, 9, 0.95),
     (0.8, 1, 0.5), (1.0, 4, 0.05)],
)
def test_sampling_probs_matches_transformers_warpers(temperature, top_k, top_p):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = gen(1234 + top_k)
    lg = torch.randn(400, V, generator=g) * 2.5
    lg[:100] = torch.round(lg[:100])  # many ties
    lg[100:150, :3] = NINF  # already filtered entries
    procs = LogitsProcessorList([TemperatureLogitsWarper(temperature)])  # generate()'s order
    if top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))
    warped = procs(torch.zeros(400, 1, dtype=torch.long), lg.clone())
    ref = torch.softmax(warped, dim=-1)
    p = sampling_probs(lg, temperature, top_k, top_p)
    assert torch.equal(p > 0, torch.isfinite(warped))
    assert torch.allclose(p, ref, atol=1e-6, rtol=1e-5)
    # batched with K+1 positions: same per position
    p3 = sampling_probs(lg.reshape(100, 4, V), temperature, top_k, top_p)
    assert torch.equal(p3.reshape(400, V) > 0, p > 0)


# ---------------------------------------- sample_from


def test_sample_from_inverse_cdf():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4] + [0.0] * 6]).expand(6, V)
    u = torch.tensor([0.0, 0.05, 0.1001, 0.35, 0.6001, 0.999])
    assert sample_from(probs, u).tolist() == [0, 0, 1, 2, 3, 3]
    # unnormalised probabilities are scaled by their total
    assert sample_from(probs * 5, u).tolist() == [0, 0, 1, 2, 3, 3]
    out = sample_from(probs, u)
    assert out.dtype == torch.long and out.shape == (6,)


def test_sample_from_is_deterministic_and_row_wise():
    g = gen(7)
    probs = torch.softmax(torch.randn(50, V, generator=g), -1)
    u = torch.rand(50, generator=g)
    a = sample_from(probs, u)
    assert torch.equal(a, sample_from(probs.clone(), u.clone()))
    for b in range(50):
        assert int(sample_from(probs[b : b + 1], u[b : b + 1])) == int(a[b])
        cdf = probs[b].double().cumsum(0)
        # the chosen token's CDF interval contains u
        lo = 0.0 if a[b] == 0 else float(cdf[a[b] - 1])
        assert lo <= float(u[b]) * float(cdf[-1]) < float(cdf[a[b]])


def test_sample_from_never_returns_zero_probability_token():
    probs = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    below_one32 = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))
    cases = {0.0: 2, 0.4999: 2, 0.5: 4, 0.75: 4, below_one32: 4}
    for u, tok in cases.items():
        for dtype in (torch.float32, torch.float64):
            got = int(sample_from(probs, torch.tensor([u], dtype=dtype)))
            assert got == tok, (u, dtype)
    assert int(sample_from(probs, torch.tensor([1.0 - 1e-15], dtype=torch.float64))) == 4
    # u = 1 (or a float32 that rounds to 1) is out of range: still a token of positive mass
    for u in (torch.tensor([1.0]), torch.tensor([1.0 - 1e-15], dtype=torch.float32)):
        assert float(probs[0, int(sample_from(probs, u))]) > 0
    # float32 probabilities whose total is not exactly 1
    lg = torch.tensor([[NINF, 0.3, 1.7, NINF, 0.1, NINF, NINF, 2.2, NINF, NINF]])
    probs = torch.softmax(lg, -1)
    for u in (0.0, below_one32, 1.0 - 1e-16, 1.0):
        tok = int(sample_from(probs, torch.tensor([u], dtype=torch.float64)))
        assert float(probs[0, tok]) > 0


@HYP
@given(
    st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=V, max_size=V).filter(
        lambda xs: sum(xs) > 0
    ),
    st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.sampled_from([0.0, 1 - 1e-16, 1 - 1e-9])),
)
def test_property_sample_from_support(probs, u):
    probs_t = torch.tensor([probs], dtype=torch.float32)
    tok = int(sample_from(probs_t, torch.tensor([u], dtype=torch.float64)))
    assert probs[tok] > 0


# ---------------------------------------- the draw (the sampling oracle)


def gumbel_noise(seed: int, t: int, index: int) -> float:
    return -math.log(-math.log(reference_uniform(seed, t, index)))


def ref_draw(p: torch.Tensor, seed: int, t: int) -> int:
    """The draw of output position t from the law p [V], written in plain Python from
    marscli.verification.draws' docstring on its plain-integer noise (``reference_uniform``):
    Gumbel-max over the candidates (p(v) >= CANDIDATE_RATIO * max p), the tail as ONE Gumbel
    variable of log P(tail), and, when the tail wins, an inverse-CDF pick within the tail."""
    ps = p.float()
    cand = (ps >= ps.max() * CANDIDATE_RATIO).tolist()
    vals = ps.tolist()
    best, pick = -math.inf, -1
    for v, (pv, c) in enumerate(zip(vals, cand)):
        if c:
            score = math.log(pv) + gumbel_noise(seed, t, v)
            if score > best:
                best, pick = score, v
    tail = [0.0 if c else pv for pv, c in zip(vals, cand)]
    mass = math.fsum(tail)
    if mass > 0 and math.log(mass) + gumbel_noise(seed, t, TAIL) > best:
        x = reference_uniform(seed, t, TAIL_PICK) * mass
        acc = 0.0
        for v, pv in enumerate(tail):
            acc += pv
            if pv > 0 and acc > x:
                return v
        return max(v for v, pv in enumerate(tail) if pv > 0)
    return pick


def test_reference_draw_is_the_coupled_draw():
    """The oracle the sampling tests below use is the verifier's draw: on 10-token laws
    (peaked, filtered, tempered) and on 400-token laws whose tail wins now and then."""
    g = gen(0)
    z = torch.randn(600, V, generator=g) * 3
    z[200:300, 5:] = NINF
    seeds = torch.randint(0, 2**50, (600,), generator=g)
    positions = torch.randint(0, 10**6, (600,), generator=g)
    for p in (sampling_probs(z, 1.0), sampling_probs(z, 0.7, top_k=3, top_p=0.9)):
        got = coupled_draw(p, position_keys(seeds, positions))
        assert got.tolist() == [ref_draw(p[i], int(seeds[i]), int(positions[i])) for i in range(600)]
    heavy = torch.ones(2000, 400)
    heavy[:, 0] = 30_000.0  # every other token far below CANDIDATE_RATIO * p(0): the tail
    heavy = heavy / heavy.sum(-1, keepdim=True)
    got = coupled_draw(heavy, position_keys(torch.full((2000,), 9), torch.arange(2000)))
    want = [ref_draw(heavy[i], 9, i) for i in range(2000)]
    assert got.tolist() == want
    assert sum(w != 0 for w in want) > 5  # the tail won in some of them


def test_sampled_draws_judge_row_j_at_the_rows_position_plus_j():
    """Row j of a step judges output position positions[b] + j: its draw is that position's,
    for the row's own seed; ``need`` only skips positions."""
    p = sampling_probs(torch.randn(4, 5, V, generator=gen(1)) * 2, 0.8)
    seeds, positions = L([0, 7, 7, 2**40]), L([0, 0, 13, 99])
    d = sampled_draws(p, seeds, positions)
    for b in range(4):
        for j in range(5):
            assert int(d[b, j]) == ref_draw(p[b, j], int(seeds[b]), int(positions[b]) + j)
    need = torch.rand(4, 5, generator=gen(2)) < 0.5
    part = sampled_draws(p, seeds, positions, need)
    assert torch.equal(part[need], d[need]) and (part[~need] == 0).all()


# ---------------------------------------- sampling: branches

SEEDS = list(range(400))


def test_strict_sampling_keeps_a_draft_exactly_where_it_is_the_draw():
    """Strict sampling: a draft is accepted iff it equals its position's draw; a rejected
    draft gives way to that draw (so it is never re-emitted); a deterministic draft is kept
    with probability p(x)."""
    lg = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1] + [1e-9] * 6, [0.1] * 10]]))
    p = sampling_probs(lg[0], 1.0)
    n = len(SEEDS)
    r = sample(L([[1]] * n), lg.expand(n, -1, -1), SEEDS, [7] * n)
    hits = 0
    for s in SEEDS:
        d0, d1 = ref_draw(p[0], s, 7), ref_draw(p[1], s, 8)
        if d0 == 1:
            hits += 1
            assert (int(r.num_accepted[s]), int(r.next_token[s])) == (1, d1), s
        else:
            assert (int(r.num_accepted[s]), int(r.next_token[s])) == (0, d0), s
            assert d0 != 1
        assert r.strict_ok[s].tolist() == [d0 == 1, False]  # no proposal after the draft
    assert not r.relaxed.any() and not r.relaxable.any()
    assert 0 < hits < n
    assert abs(hits / n - 0.3) < 5 * math.sqrt(0.3 * 0.7 / n)


def test_drafts_drawn_with_the_positions_noise_are_kept_as_the_coupling_promises():
    """A drafter that draws its token from its own law q with the position's noise agrees
    with the target's draw with probability >= (1 - d) / (1 + d), d = TV(p, q), far more
    often than one with independent noise (sum_x q(x) p(x)); the emitted law is p either way."""
    N = 20_000
    p = P_TARGET[0]
    q = torch.softmax(TARGET[0] + 0.5 * torch.randn(V, generator=gen(3)), -1)
    d = 0.5 * float((p - q).abs().sum())
    seeds = torch.arange(N)
    keys = position_keys(seeds, torch.full((N,), 5))
    coupled = coupled_draw(q.expand(N, V), keys).view(N, 1)
    independent = sample_from(q.expand(N, V), torch.rand(N, generator=gen(4))).view(N, 1)
    lg = TARGET[:2].unsqueeze(0).expand(N, -1, -1)
    rates = []
    for drafts in (coupled, independent):
        r = sample(drafts, lg, seeds, torch.full((N,), 5))
        assert fits(token_at(r, drafts, 0)[0], p)
        rates.append(float((r.num_accepted == 1).double().mean()))
    assert rates[0] >= (1 - d) / (1 + d) - 0.02, (rates, d)
    agree = float((q * p).sum())
    assert abs(rates[1] - agree) < 5 * math.sqrt(agree * (1 - agree) / N)
    assert rates[0] > rates[1] + 0.2


def test_a_certain_draft_is_always_accepted():
    """p(3) = 1 (every other token ~1e-44, a float32 denormal): the draw is 3 at every seed
    (the tail of denormal mass never wins), so the draft is always accepted."""
    lg = torch.tensor([[row({3: 100.0}, fill=0.0), row({8: 100.0}, fill=0.0)]])
    n = 500
    r = sample(L([[3]] * n), lg.expand(n, -1, -1), range(n), [0] * n)
    assert (r.num_accepted == 1).all() and (r.next_token == 8).all()


@pytest.mark.parametrize("bonus", [NO_PROPOSAL, 0, 1, 9])
def test_strict_sampling_emits_the_draw_after_the_drafts_whatever_the_bonus(bonus):
    """All drafts accepted: the next token is the draw of the position after them; a bonus
    proposal is kept only where it is that draw, so it changes nothing."""
    lg = torch.log(torch.tensor([[[0.5, 0.5] + [1e-12] * 8, [0.3, 0.2, 0.1] + [0.4 / 7] * 7]]))
    p = sampling_probs(lg[0], 1.0)
    n = len(SEEDS)
    r = sample(L([[0]] * n), lg.expand(n, -1, -1), SEEDS, [3] * n, bonus=L([bonus] * n))
    for s in SEEDS:
        d0, d1 = ref_draw(p[0], s, 3), ref_draw(p[1], s, 4)
        want = ([0, d1] if d0 == 0 else [d0])
        assert r.emitted(L([[0]] * n), s) == want, s
        # a per-position fact, whether or not the step reaches the position
        assert bool(r.strict_ok[s, 1]) == (bonus == d1)
    assert not r.relaxed.any()


@pytest.mark.parametrize("rule", [rule_from_theta(INF), Rule(MARS, 0.0, PROB_RATIO)], ids=["strict", "mars"])
def test_filtered_draft_never_accepted(rule):
    """A draft the filters remove (p = 0) is never accepted, whatever the seed or the rule,
    and nothing outside the filtered support is ever emitted."""
    lg = torch.tensor([[row({0: 3.0, 1: 2.9, 2: 2.8, 5: 2.7}, fill=0.0), row({}, fill=0.0)]])
    n = 200
    for draft in (2, 5, 9):
        r = sample(L([[draft]] * n), lg.expand(n, -1, -1), range(n), [0] * n, rule=rule, top_k=2,
                   bonus=L([draft] * n))
        assert (r.num_accepted == 0).all()
        assert set(r.next_token.tolist()) == {0, 1}
        assert not r.relaxed.any()
    # a draft inside the support: strict keeps it where it is the draw, MARS (a top-2 at a
    # relaxable position) always
    r = sample(L([[1]] * n), lg.expand(n, -1, -1), range(n), [0] * n, rule=rule, top_k=2)
    if rule.relaxes:
        assert (r.num_accepted == 1).all()
    else:
        assert 0 < int(r.num_accepted.sum()) < n


def test_mars_sampling_branches():
    """At a relaxable position (logit ratio 0.9 > theta 0.8) a top-1 or top-2 draft is kept
    for every seed (relaxed exactly where it is not the draw); a top-3 draft is kept only
    where it is the draw, else the draw is emitted; strict keeps any draft only as the draw."""
    lg = torch.tensor([[row({2: 4.0, 3: 3.6, 6: 3.0}, fill=0.0), row({}, fill=0.0)]])
    p = sampling_probs(lg[0], 1.0)
    n = len(SEEDS)
    d0 = [ref_draw(p[0], s, 11) for s in SEEDS]
    d1 = [ref_draw(p[1], s, 12) for s in SEEDS]
    for draft in (2, 3, 6):
        for theta in (0.8, INF):
            r = sample(L([[draft]] * n), lg.expand(n, -1, -1), SEEDS, [11] * n, rule=rule_from_theta(theta))
            kept_outright = theta == 0.8 and draft in (2, 3)
            for s in SEEDS:
                kept = kept_outright or d0[s] == draft
                assert r.emitted(L([[draft]] * n), s) == ([draft, d1[s]] if kept else [d0[s]]), (draft, theta, s)
                assert bool(r.relaxed[s, 0]) == (kept_outright and d0[s] != draft)
                assert bool(r.strict_ok[s, 0]) == (d0[s] == draft)
            assert r.relaxable[:, 0].all() == (theta == 0.8) and not r.relaxable[:, 1].any()
            # both branches are seen: the draw is the draft at some seeds and not at others
            assert 0 < sum(x == draft for x in d0) < n
    # the statistic is reported from the raw logits, under strict too
    r = sample(L([[3]]), lg, [0], [0])
    assert float(r.statistic[0, 0]) == NOT_RELAXABLE  # strict computes none
    r = sample(L([[3]]), lg, [0], [0], rule=rule_from_theta(0.95))
    assert float(r.statistic[0, 0]) == pytest.approx(0.9) and not r.relaxable.any()


def test_mars_sampling_keeps_a_top_two_bonus_at_a_relaxable_position():
    """The position after the drafts is judged like the drafts: a top-2 bonus proposal at a
    close call is kept for every seed (relaxed where it is not the draw)."""
    lg = torch.tensor([[argmax_row(4), row({2: 4.0, 3: 3.6}, fill=0.0)]])
    p = sampling_probs(lg[0], 1.0)
    n = len(SEEDS)
    r = sample(L([[4]] * n), lg.expand(n, -1, -1), SEEDS, [0] * n, rule=rule_from_theta(0.8),
               bonus=L([3] * n))
    assert (r.num_accepted == 1).all() and (r.next_token == 3).all()
    d1 = torch.tensor([ref_draw(p[1], s, 1) for s in SEEDS])
    assert torch.equal(r.relaxed[:, 1], d1 != 3) and r.relaxable[:, 1].all()
    assert not r.relaxed[:, 0].any()


def test_mars_sampling_statistic_from_raw_logits_not_tempered():
    # prob-ratio on raw logits exp(-0.3) = 0.741 > 0.7, on logits / 0.5 it would be 0.549
    lg = torch.tensor([[row({2: 1.0, 3: 0.7}, fill=-5.0), row({}, fill=0.0)]])
    for t in (0.5, 1.0, 2.0):
        r = sample(L([[3]] * 50), lg.expand(50, -1, -1), range(50), [0] * 50, temperature=t,
                   rule=rule_from_theta(0.7, PROB_RATIO))
        assert r.statistic[:, 0].tolist() == pytest.approx([math.exp(-0.3)] * 50, rel=1e-5)
        assert r.relaxable[:, 0].all() and (r.num_accepted == 1).all()


def test_mars_sampling_z1_non_positive_not_relaxable():
    lg = torch.tensor([[row({2: -1.0, 3: -1.01}, fill=-9.0), row({}, fill=0.0)]])
    p = sampling_probs(lg[0], 1.0)
    n = 200
    r = sample(L([[3]] * n), lg.expand(n, -1, -1), range(n), [0] * n, rule=rule_from_theta(0.5, LOGIT_RATIO))
    assert not r.relaxable.any() and not r.relaxed.any()
    assert r.num_accepted.tolist() == [int(ref_draw(p[0], s, 0) == 3) for s in range(n)]
    r = sample(L([[3]] * n), lg.expand(n, -1, -1), range(n), [0] * n, rule=rule_from_theta(0.5, PROB_RATIO))
    assert r.relaxable[:, 0].all() and (r.num_accepted == 1).all()


def test_mars_sampling_filtered_top2_never_accepted():
    # a tie z1 == z2 would be kept by top-k = 1; make top-2 strictly lower so top-k removes it
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0), row({}, fill=0.0)]])
    n = 100
    for margin in (LOGIT_RATIO, PROB_RATIO):
        for kw in (dict(top_k=1), dict(top_p=0.3)):
            r = sample(L([[3]] * n), lg.expand(n, -1, -1), range(n), [0] * n, rule=rule_from_theta(0.5, margin),
                       **kw)
            assert r.relaxable[:, 0].all()
            assert (r.num_accepted == 0).all() and (r.next_token == 2).all()


def test_draft_len_padding_sampling():
    """Padding is never accepted, relaxed nor relaxable; the next token is the draw of the
    position after each row's own drafts."""
    K = 3
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0)] * K + [row({7: 9.0})]] * 3)
    drafts = L([[2, 2, 2]] * 3)
    dl = L([3, 1, 0])
    p = sampling_probs(lg[0], 1.0)
    for s in range(50):
        draws = [[ref_draw(p[j], s + b, 5 + j) for j in range(K + 1)] for b in range(3)]
        for theta in (INF, 0.5):
            r = sample(drafts, lg, [s, s + 1, s + 2], [5, 5, 5], rule=rule_from_theta(theta), draft_len=dl)
            for b in range(3):
                n, m = int(r.num_accepted[b]), int(dl[b])
                if theta == 0.5:  # the top-1 at a relaxable position: every real draft kept
                    assert n == m and r.emitted(drafts, b) == [2] * m + [draws[b][m]]
                    # relaxed where the draw was not the draft, never at padding
                    assert r.relaxed[b].tolist() == [j < m and draws[b][j] != 2 for j in range(K + 1)]
                else:  # strict: the draws themselves
                    assert n <= m and r.emitted(drafts, b) == draws[b][: n + 1]
                    assert not r.relaxed[b].any()
            if theta == 0.5:
                assert r.relaxable.tolist() == [[True] * 3 + [False], [True] + [False] * 3, [False] * 4]
            else:
                assert not r.relaxable.any()
    # a padded slot is never accepted even when it would be with probability 1
    lg1 = torch.tensor([[row({4: 50.0})] * 2])
    for s in range(20):
        r = sample(L([[4]]), lg1, [s], [0], draft_len=L([0]))
        assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [4]
        assert not r.strict_ok.any()


def test_verify_dispatch_sampling_and_shape_errors():
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0), row({}, fill=0.0)]])
    with pytest.raises(AssertionError, match="seeds and positions"):
        verify(L([[3]]), lg, rule=rule_from_theta(0.5), temperature=1.0)
    with pytest.raises(AssertionError, match="seeds and positions"):
        verify(L([[3]]), lg, rule=rule_from_theta(0.5), temperature=1.0, seeds=L([1]))
    p = sampling_probs(lg[0], 1.0)
    for s in range(30):
        r = verify(L([[3]]), lg, rule=rule_from_theta(0.5), temperature=1.0, seeds=L([s]), positions=L([2]))
        assert r.num_accepted.tolist() == [1]
        assert r.relaxed.tolist() == [[ref_draw(p[0], s, 2) != 3, False]]


# ---------------------------------------- sampling: reference


def ref_sample_row(drafts, lg, *, n_real, bonus, seed, position, temperature, top_k, top_p, theta, margin):
    """One row of strict/MARS sampling written from the rules, position by position: the
    target's token at position i is ref_draw(p_i, seed, position + i); the proposal there
    (draft i, or the bonus after the row's drafts) is kept when it is that draw, or (MARS)
    when the position is relaxable and the proposal is the top-1 or top-2 with p > 0.

    Returns (n accepted, next token, relaxed flags [K+1], relaxable flags [K+1])."""
    K = len(drafts)
    p = sampling_probs(lg.unsqueeze(0), temperature, top_k, top_p)[0]  # [K+1, V]
    relaxed = [False] * (K + 1)
    relaxable = [False] * (K + 1)
    for i in range(n_real + 1):
        x = drafts[i] if i < n_real else bonus
        own = ref_draw(p[i], seed, position + i)
        if x == NO_PROPOSAL:
            return i, own, relaxed, relaxable
        t1, t2, z1, z2 = ref_top2(lg[i].tolist())
        relaxable[i] = ref_stat(z1, z2, margin) > theta
        if x == own:
            kept = True
        elif relaxable[i] and x in (t1, t2) and float(p[i, x]) > 0:
            kept = relaxed[i] = True
        else:
            kept = False
        if not kept:
            return i, own, relaxed, relaxable
        if i == n_real:
            return n_real, x, relaxed, relaxable
    raise AssertionError("unreachable")


finite_logit_row = st.lists(any_logit, min_size=V, max_size=V).filter(lambda r: any(math.isfinite(z) for z in r))


@st.composite
def sampling_case(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(0, 4))
    lg = draw(st.lists(st.lists(finite_logit_row, min_size=K + 1, max_size=K + 1), min_size=B, max_size=B))
    lg = torch.tensor(lg, dtype=torch.float32)
    params = dict(
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 1, 2, 3, V])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])),
        theta=draw(st.sampled_from([INF, 0.0, 0.3, 0.6, 0.9])),
        margin=draw(st.sampled_from([LOGIT_RATIO, PROB_RATIO])),
    )
    seeds = L(draw(st.lists(st.integers(0, 2**62), min_size=B, max_size=B)))
    positions = L(draw(st.lists(st.integers(0, 10**6), min_size=B, max_size=B)))
    # proposals biased to the top-1 / top-2 and to the position's own draw, so that every
    # branch is common
    p = sampling_probs(lg, params["temperature"], params["top_k"], params["top_p"])
    draws = sampled_draws(p, seeds, positions)  # [B, K+1]
    tokens = biased_tokens(draw, lg, (B, K + 1))
    as_draw = torch.tensor(draw(st.lists(st.booleans(), min_size=B * (K + 1), max_size=B * (K + 1))))
    tokens = torch.where(as_draw.view(B, K + 1), draws, tokens)
    dl = L(draw(st.lists(st.integers(0, K), min_size=B, max_size=B)))
    dl = dl if draw(st.booleans()) else None
    drafts = tokens[:, :K]
    bonus = None
    if draw(st.booleans()):
        at = torch.full((B,), K) if dl is None else dl
        bonus = tokens[torch.arange(B), at]
        none = torch.tensor(draw(st.lists(st.booleans(), min_size=B, max_size=B)))
        bonus = torch.where(none, torch.full_like(bonus, NO_PROPOSAL), bonus)
    return drafts, lg, dl, bonus, seeds, positions, params


def sampled(drafts, lg, dl, bonus, seeds, positions, params) -> VerifyResult:
    kw = dict(params)
    rule = rule_from_theta(kw.pop("theta"), kw.pop("margin"))
    return verify(drafts, lg, rule=rule, draft_len=dl, bonus=bonus, seeds=seeds, positions=positions, **kw)


@HYP_SLOW
@given(sampling_case())
def test_property_sampling_matches_reference(case):
    drafts, lg, dl, bonus, seeds, positions, params = case
    B, K = drafts.shape
    r = sampled(*case)
    p = sampling_probs(lg, params["temperature"], params["top_k"], params["top_p"])
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        bx = NO_PROPOSAL if bonus is None else int(bonus[b])
        n, nxt, relaxed, relaxable = ref_sample_row(
            drafts[b].tolist(), lg[b], n_real=n_real, bonus=bx, seed=int(seeds[b]),
            position=int(positions[b]), **params)
        assert int(r.num_accepted[b]) == n
        assert int(r.next_token[b]) == nxt
        assert r.relaxed[b].tolist() == relaxed
        proposed = [j < n_real or (j == n_real and bx != NO_PROPOSAL) for j in range(K + 1)]
        reported = [a and c for a, c in zip(relaxable, proposed)]
        assert r.relaxable[b, : n + 1].tolist() == reported[: n + 1]
        assert not r.relaxable[b, n_real + 1:].any()  # padding is never relaxable
        # nothing the target could not sample is ever emitted
        for j, tok in enumerate(r.emitted(drafts, b)):
            assert float(p[b, j, tok]) > 0
        # rows are independent
        alone = sampled(drafts[b: b + 1], lg[b: b + 1], None if dl is None else dl[b: b + 1],
                        None if bonus is None else bonus[b: b + 1], seeds[b: b + 1], positions[b: b + 1], params)
        assert_same_result(result_row(r, b), alone)
    if math.isinf(params["theta"]):
        assert not r.relaxable.any() and not r.relaxed.any()
    assert not (r.relaxed & ~r.relaxable).any()


@HYP_SLOW
@given(sampling_case())
def test_property_theta_inf_sampling_ignores_margin_and_equals_strict(case):
    drafts, lg, dl, bonus, seeds, positions, params = case
    kw = {k: v for k, v in params.items() if k not in ("theta", "margin")}
    common = dict(draft_len=dl, bonus=bonus, seeds=seeds, positions=positions, **kw)
    a = verify(drafts, lg, rule=Rule(MARS, INF, LOGIT_RATIO), **common)
    b = verify(drafts, lg, rule=Rule(MARS, INF, PROB_RATIO), **common)
    s = verify(drafts, lg, rule=Rule(STRICT), **common)
    for x in (a, b):
        assert torch.equal(x.num_accepted, s.num_accepted) and torch.equal(x.next_token, s.next_token)
        assert not x.relaxed.any()
    # strict sampling emits the draws, whatever the proposals
    draws = sampled_draws(sampling_probs(lg, **kw), seeds, positions)
    for row in range(drafts.shape[0]):
        n = int(s.num_accepted[row])
        assert s.emitted(drafts, row) == draws[row, : n + 1].tolist()


# ---------------------------------------- distributions

# target logits for 4 positions (context-independent target), and a deterministic draft
TARGET = torch.log(torch.tensor([
    [0.06, 0.30, 0.04, 0.20, 0.10, 0.05, 0.15, 0.03, 0.05, 0.02],
    [0.10, 0.05, 0.25, 0.05, 0.20, 0.05, 0.10, 0.05, 0.10, 0.05],
    [0.30, 0.02, 0.08, 0.10, 0.10, 0.10, 0.10, 0.10, 0.05, 0.05],
    [0.01, 0.09, 0.10, 0.10, 0.30, 0.10, 0.10, 0.05, 0.05, 0.10],
]))
P_TARGET = torch.softmax(TARGET, -1)
ONE_HOT_DRAFTS = [1, 2, 0]  # p = 0.30, 0.25, 0.30: accepted often enough to see positions 1-3
DRAFTERS = ["one-hot", "random", "coupled"]


def make_drafts(drafter: str, n: int, K: int, seeds: torch.Tensor, position: int, logits: torch.Tensor,
                drafts_row=None) -> torch.Tensor:
    """[n, K] drafts: a deterministic row, uniformly random tokens, or draws from a drafter's
    law far from the target (reversed probabilities) made with each position's own noise."""
    if drafter == "one-hot":
        return L((ONE_HOT_DRAFTS if drafts_row is None else drafts_row)[:K]).unsqueeze(0).expand(n, -1)
    if drafter == "random":
        return torch.randint(0, V, (n, K), generator=gen(int(seeds[0]) + 1))
    q = torch.softmax(logits[:K], -1).flip(-1)  # [K, V]
    keys = position_keys(seeds.view(n, 1).expand(n, K), position + torch.arange(K).view(1, K))
    return coupled_draw(q.unsqueeze(0).expand(n, K, V).reshape(n * K, V), keys.reshape(-1)).view(n, K)


def run_sampled(n: int, K: int, seed: int, *, rule: Rule = STRICT_RULE, logits: torch.Tensor | None = None,
                drafter: str = "one-hot", drafts_row=None, position: int = 0, temperature: float = 1.0,
                top_k: int = 0, top_p: float = 1.0, **kw) -> tuple[VerifyResult, torch.Tensor, torch.Tensor]:
    """n records (seeds seed * 1_000_003 + i) verify one step of K drafts at `position`;
    returns the result, the drafts and every position's draw (sampled_draws)."""
    lg = (TARGET if logits is None else logits)[: K + 1]
    seeds = seed * 1_000_003 + torch.arange(n)
    pos = torch.full((n,), position)
    drafts = make_drafts(drafter, n, K, seeds, position, lg, drafts_row)
    lgn = lg.unsqueeze(0).expand(n, -1, -1)
    r = verify(drafts, lgn, rule=rule, temperature=temperature, top_k=top_k, top_p=top_p, seeds=seeds,
               positions=pos, **kw)
    draws = sampled_draws(sampling_probs(lgn, temperature, top_k, top_p), seeds, pos)
    return r, drafts, draws


def emitted_are_the_draws(r: VerifyResult, drafts: torch.Tensor, draws: torch.Tensor) -> bool:
    """Every row's emitted tokens are its positions' draws (vectorised)."""
    n, K = drafts.shape
    j = torch.arange(K + 1).view(1, K + 1)
    tok = torch.cat([drafts, torch.zeros(n, 1, dtype=torch.long)], 1)
    tok = torch.where(j == r.num_accepted.view(n, 1), r.next_token.view(n, 1), tok)
    upto = j <= r.num_accepted.view(n, 1)
    return bool((tok[upto] == draws[upto]).all())


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_strict_sampling_emits_the_draws_and_reproduces_the_target(K, drafter):
    """Drafter invariance: whatever the drafts (a fixed row, random tokens, coupled draws
    from a far law), whatever the draft lengths and bonus proposals, strict sampling emits
    exactly each position's draw; so the token at every position has the target's law p
    (chi-square at position 0, and at later positions given the step reached them)."""
    N = 20_000
    g = gen(K)
    kw = dict(draft_len=torch.randint(0, K + 1, (N,), generator=g), bonus=torch.randint(-1, V, (N,), generator=g))
    r, drafts, draws = run_sampled(N, K, seed=11 + K, drafter=drafter, **kw)
    assert emitted_are_the_draws(r, drafts, draws)
    assert not r.relaxed.any()
    r2, _, _ = run_sampled(N, K, seed=11 + K, drafter=drafter)  # full drafts, no bonus
    assert emitted_are_the_draws(r2, drafts, draws)
    for res in (r, r2):
        assert fits(token_at(res, drafts, 0)[0], P_TARGET[0])
        for pos in range(1, K + 1):
            tok, reached = token_at(res, drafts, pos)
            if int(reached.sum()) > 200:
                assert fits(tok, P_TARGET[pos]), pos
    # the full-length step reaches the later positions often enough to test their law (all
    # of them but with random drafts, which are rarely the draw), and a deterministic first
    # draft is kept with probability p(x)
    for pos in range(1, (1 if drafter == "random" else K) + 1):
        assert int(token_at(r2, drafts, pos)[1].sum()) > 200, pos
    if drafter == "one-hot":
        rate = float(P_TARGET[0, ONE_HOT_DRAFTS[0]])
        acc = float((r2.num_accepted >= 1).double().mean())
        assert abs(acc - rate) < 5 * math.sqrt(rate * (1 - rate) / N)


def test_strict_sampling_tv_shrinks_with_samples():
    for drafter in ("one-hot", "coupled"):
        tvs = []
        for n in (2_000, 32_000):
            r, drafts, _ = run_sampled(n, 3, seed=5, drafter=drafter)
            t = tv(token_at(r, drafts, 0)[0], P_TARGET[0])
            assert t < tv_bound(n)
            tvs.append(t)
        assert tvs[1] < tvs[0] / 2, tvs  # ~ 1/sqrt(N): expected ratio 4


FILTERS = [dict(top_k=3), dict(top_p=0.6), dict(temperature=0.6, top_k=5, top_p=0.9)]


@pytest.mark.parametrize("kw", FILTERS, ids=["top_k", "top_p", "all"])
def test_strict_sampling_with_filtering_reproduces_filtered_target(kw):
    N = 20_000
    # draft 3 is kept by these filters at position 0; draft 9 at position 1 is not
    r, drafts, draws = run_sampled(N, 2, seed=21, drafts_row=[3, 9], **kw)
    p = sampling_probs(TARGET, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0))
    assert emitted_are_the_draws(r, drafts, draws)
    tok0, _ = token_at(r, drafts, 0)
    assert fits(tok0, p[0]) and (p[0][tok0] > 0).all()
    tok1, reached = token_at(r, drafts, 1)
    assert fits(tok1, p[1]) and int(reached.sum()) > 500
    assert (r.num_accepted < 2).all()  # the filtered draft is never accepted


# Negative controls: deliberately broken draws must fail the very checks the verifier passes.


def test_negative_control_a_draw_that_returns_the_proposal_fails(monkeypatch):
    """Accepting every draft the target could sample (the draw replaced by the proposal)
    emits the draft's one-hot law, not p."""
    real = mv.sampled_draws

    def broken(p, seeds, positions, need=None):
        out = real(p, seeds, positions, need)
        n, W, _ = p.shape
        x = L(ONE_HOT_DRAFTS[: W - 1]).view(1, W - 1).expand(n, -1)
        alive = p[:, : W - 1].gather(-1, x.unsqueeze(-1)).squeeze(-1) > 0
        out[:, : W - 1] = torch.where(alive, x, out[:, : W - 1])
        return out

    r, drafts, _ = run_sampled(20_000, 1, seed=4)
    assert fits(token_at(r, drafts, 0)[0], P_TARGET[0])
    monkeypatch.setattr(mv, "sampled_draws", broken)
    for n in (2_000, 20_000):
        r, drafts, _ = run_sampled(n, 1, seed=4)
        assert not fits(token_at(r, drafts, 0)[0], P_TARGET[0]), n


def test_negative_control_ignoring_the_filters_fails(monkeypatch):
    """Drawing from the unfiltered law emits tokens top-k removed: the filtered-law check fails."""
    real = mv.sampling_probs
    p = sampling_probs(TARGET, 1.0, 3)
    r, drafts, _ = run_sampled(20_000, 1, seed=6, top_k=3)
    assert fits(token_at(r, drafts, 0)[0], p[0])
    monkeypatch.setattr(mv, "sampling_probs", lambda logits, temperature, top_k=0, top_p=1.0: real(logits, temperature))
    for n in (2_000, 20_000):
        r, drafts, _ = run_sampled(n, 1, seed=6, top_k=3)
        tok0 = token_at(r, drafts, 0)[0]
        assert not fits(tok0, p[0]), n
        assert (p[0][tok0] == 0).any()


def test_negative_control_noise_that_is_not_gumbel_fails(monkeypatch):
    """argmax(log p + U) with uniform noise U is not a draw from p (it favours the likely
    tokens): the same chi-square check tells it apart."""
    def broken(probs, keys, token_ids=None):
        idx = torch.arange(probs.shape[1]).view(1, -1)
        return (torch.log(probs.double()) + uniforms(keys.view(-1, 1), idx)).argmax(-1)

    monkeypatch.setattr(mv, "coupled_draw", broken)
    for n in (2_000, 20_000):
        r, drafts, _ = run_sampled(n, 1, seed=8)
        assert not fits(token_at(r, drafts, 0)[0], P_TARGET[0]), n


def test_negative_control_noise_shared_by_the_positions_fails(monkeypatch):
    """The draws of a step's positions must be independent: with one law at every position,
    noise that ignores the position draws the same token at position 1 as at position 0, so
    given draft 1 was accepted (the draw was 1) position 1 would always be 1 again."""
    same = TARGET[0].expand(4, V).contiguous()
    real = mv.position_keys
    r, drafts, _ = run_sampled(20_000, 1, seed=9, logits=same)
    tok1, reached = token_at(r, drafts, 1)
    assert fits(tok1, P_TARGET[0]) and int(reached.sum()) > 2000
    monkeypatch.setattr(mv, "position_keys", lambda seeds, positions: real(seeds, torch.zeros_like(positions)))
    r, drafts, _ = run_sampled(20_000, 1, seed=9, logits=same)
    tok1, reached = token_at(r, drafts, 1)
    assert not fits(tok1, P_TARGET[0])


# MARS: position 0 is a close call (logit ratio 0.95 between tokens 1 and 3)
MARS_LOGITS = torch.stack([
    torch.tensor([1.0, 4.0, 0.5, 3.8, 2.5, 0.0, 2.0, -1.0, 1.5, 0.2]),
    TARGET[1] + 3.0,
    TARGET[2] + 3.0,
    TARGET[3] + 3.0,
])


def mars_law(p: torch.Tensor, draft: int, relaxable: bool, t1: int, t2: int, q=None):
    """Analytic law of the token a sampled MARS step emits at one position: a top-1/top-2
    proposal (p > 0) at a relaxable position is kept outright; any other proposal is kept
    only as the position's draw, so the law there is p. With drafts drawn from q independently
    of the target's noise: q(x) on the kept-outright tokens, the rest of the mass as p."""
    if not relaxable:
        return p
    if q is None:
        if draft in (t1, t2) and p[draft] > 0:
            return torch.nn.functional.one_hot(L(draft), V).float()
        return p
    ok = torch.zeros(V)
    for x in (t1, t2):
        if p[x] > 0:
            ok[x] = q[x]
    return ok + (1 - ok.sum()) * p


@pytest.mark.parametrize(
    ("draft", "theta", "kw"),
    [
        (1, 0.9, {}),  # top-1 at a relaxable position: always emitted
        (3, 0.9, {}),  # top-2: always emitted
        (4, 0.9, {}),  # top-3 at a relaxable position: kept only as the draw, law p
        (0, 0.9, {}),
        (3, 0.96, {}),  # not relaxable: strict, law p
        (4, 0.96, {}),
        (3, 0.9, {"top_k": 1}),  # top-2 filtered out: never accepted, law p = one-hot(top-1)
        (3, 0.9, {"top_p": 0.4}),  # top-p keeps only the top-1
        (3, 0.9, {"top_k": 3, "temperature": 0.7}),
        (4, 0.9, {"top_k": 2}),  # top-3 filtered
    ],
)
def test_mars_sampling_follows_its_analytic_law(draft, theta, kw):
    N = 20_000
    temperature = kw.get("temperature", 1.0)
    r, drafts, draws = run_sampled(N, 2, seed=31 + draft, rule=rule_from_theta(theta), logits=MARS_LOGITS,
                                   drafts_row=[draft, 2], **kw)
    p = sampling_probs(MARS_LOGITS, temperature, kw.get("top_k", 0), kw.get("top_p", 1.0))
    relaxable = 0.95 > theta
    assert bool(r.relaxable[:, 0].all()) == relaxable and bool(r.relaxable[:, 0].any()) == relaxable
    law0 = mars_law(p[0], draft, relaxable, 1, 3)
    tok0, _ = token_at(r, drafts, 0)
    assert fits(tok0, law0)
    assert (p[0][tok0] > 0).all()
    if relaxable and draft in (1, 3) and p[0, draft] > 0:
        assert (r.num_accepted >= 1).all()
        # relaxed exactly where the draft is not the position's draw
        assert torch.equal(r.relaxed[:, 0], draws[:, 0] != draft)
        assert 0 < float(r.relaxed[:, 0].double().mean()) < 1
    else:
        # kept only as the draw: the emitted token IS the draw, never a relaxation
        assert torch.equal(tok0, draws[:, 0]) and not r.relaxed[:, 0].any()
        if p[0, draft] > 0:
            # the draft is emitted at rate p(x): the draw's law, not a residual's
            rate = float((tok0 == draft).double().mean())
            assert abs(rate - float(p[0, draft])) < 5 * math.sqrt(float(p[0, draft]) / N)
    # position 1 (logit ratio 0.86: not relaxable at theta >= 0.9): strict, the draws, law p_1
    tok1, reached = token_at(r, drafts, 1)
    assert torch.equal(tok1, draws[reached, 1])
    if int(reached.sum()) > 500:
        assert fits(tok1, p[1])
    assert not r.relaxable[:, 1].any()


def test_mars_sampling_analytic_law_with_real_q():
    """Drafts drawn from a drafter's law q with independent noise: the token at the relaxable
    position has law q(t1), q(t2) on the top two, the rest p; the draft is kept with
    probability q(t1) + q(t2) + sum over the other tokens of q(x) p(x)."""
    N = 30_000
    g = gen(99)
    p = torch.softmax(MARS_LOGITS, -1)
    q0 = torch.softmax(torch.tensor([0.0, 0.5, 0.5, 2.5, 1.5, -1.0, 0.3, 0.0, 0.0, 2.0]), -1)
    q = torch.stack([q0, P_TARGET[1].flip(-1)])
    drafts = torch.stack([sample_from(q[i].expand(N, V), torch.rand(N, generator=g)) for i in range(2)], 1)
    lg = MARS_LOGITS[:3].unsqueeze(0).expand(N, -1, -1)
    seeds = torch.arange(N) + 77
    r = verify(drafts, lg, rule=rule_from_theta(0.9), temperature=1.0, seeds=seeds,
               positions=torch.zeros(N, dtype=torch.long))
    tok0, _ = token_at(r, drafts, 0)
    law0 = mars_law(p[0], -1, True, 1, 3, q=q0)
    assert fits(tok0, law0)
    # the MARS law is not the target's, and the test can tell them apart
    assert 0.5 * float((law0 - p[0]).abs().sum()) > 3 * tv_bound(N)
    assert not fits(tok0, p[0])
    tok1, reached = token_at(r, drafts, 1)
    assert fits(tok1, p[1])
    others = [x for x in range(V) if x not in (1, 3)]
    rate = float(q0[1] + q0[3] + (q0[others] * p[0, others]).sum())
    acc = float((r.num_accepted >= 1).double().mean())
    assert abs(acc - rate) < 5 * math.sqrt(rate * (1 - rate) / N)


def test_mars_sampling_with_theta_inf_is_strict_in_law_and_per_sample():
    N = 20_000
    a, drafts, draws = run_sampled(N, 2, seed=8, logits=MARS_LOGITS, drafts_row=[3, 2])
    b, _, _ = run_sampled(N, 2, seed=8, logits=MARS_LOGITS, drafts_row=[3, 2], rule=Rule(MARS, INF, PROB_RATIO))
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert emitted_are_the_draws(b, drafts, draws)
    assert fits(token_at(b, drafts, 0)[0], torch.softmax(MARS_LOGITS, -1)[0])


# ---------------------------------------- shapes


def test_shape_assertions():
    lg = torch.zeros(2, 4, V)
    good = torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(AssertionError, match=r"drafts must be \[B, K\]"):
        strict_greedy(torch.zeros(3, dtype=torch.long), lg)
    with pytest.raises(AssertionError, match=r"logits must be \[B, K\+1, V\]"):
        mars_greedy(good, torch.zeros(4, V), 0.5)
    with pytest.raises(AssertionError, match="do not match"):
        strict_greedy(good, torch.zeros(2, 3, V))  # K rows instead of K+1
    with pytest.raises(AssertionError, match="do not match"):
        mars_greedy(good, torch.zeros(3, 4, V), 0.5)  # batch mismatch
    seeds, positions = L([0, 1]), L([0, 0])
    with pytest.raises(AssertionError, match="do not match"):
        verify(good, torch.zeros(2, 5, V), temperature=1.0, seeds=seeds, positions=positions)
    with pytest.raises(AssertionError, match="do not match"):
        verify(good, torch.zeros(2, 3, V), rule=rule_from_theta(0.5), temperature=1.0, seeds=seeds,
               positions=positions)
    with pytest.raises(AssertionError, match="seeds and positions"):
        verify(good, lg, temperature=1.0, positions=positions)
