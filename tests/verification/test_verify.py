"""Tests of marscli.verification.chain: margin statistics, strict/MARS greedy, sampling rules and their laws.

Hand-made logits over a 10-token vocabulary check every branch of the rules; hypothesis checks
the vectorised functions against a per-row reference written straight from the rules; seeded
distribution tests (many batch rows at once, one uniform each) check that strict speculative
sampling reproduces the target distribution, that deliberately broken samplers fail the same
check, and that MARS sampling follows its own analytic per-position law.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import marscli.verification.chain as mv
from marscli.verification.chain import (
    VerifyResult,
    sample_from,
    sampling_probs,
    verify,
)
from marscli.verification.registry import LOGIT_RATIO, PROB_RATIO
from marscli.verification.rules import NOT_RELAXABLE, margin_statistic, top2
from tests.verify_helpers import mars_greedy, rule_from_theta, speculative_sampling, strict_greedy

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


def result_row(r: VerifyResult, b: int) -> VerifyResult:
    s = slice(b, b + 1)
    return VerifyResult(
        r.num_accepted[s], r.next_token[s], r.relaxed[s], r.relaxable[s], r.statistic[s]
    )


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
    assert r.relaxable.tolist() == [[False]]
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
    assert r.relaxed.shape == r.relaxable.shape == r.statistic.shape == (1, 3)
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
    assert r.relaxed.tolist() == [[True, False]]
    # row 1: z1 = 5, z2 = -10 -> ratio -2, not relaxable
    assert r.relaxable.tolist() == [[True, False]]
    assert r.statistic[0].tolist() == pytest.approx([0.9, -2.0])
    # strict rejects the same draft and emits the top-1
    s = strict_greedy(drafts, lg)
    assert (s.num_accepted.tolist(), s.next_token.tolist()) == ([0], [2])


def test_mars_greedy_top2_at_non_relaxable_position_is_rejected():
    drafts = L([[3, 5]])
    lg = logits_of([close_call(2, 3, ratio=0.5), argmax_row(5), argmax_row(8)])
    r = mars_greedy(drafts, lg, theta=0.8)
    assert r.num_accepted.tolist() == [0]
    assert r.next_token.tolist() == [2]
    assert r.relaxable.tolist() == [[False, False]]
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
    assert r.relaxable.tolist() == [[True]]
    assert r.num_accepted.tolist() == [0]
    assert r.next_token.tolist() == [2]
    assert not r.relaxed.any()


def test_mars_greedy_top1_accepted_and_not_marked_relaxed():
    drafts = L([[2, 4]])
    lg = logits_of([close_call(2, 3, ratio=0.9), close_call(4, 1, ratio=0.95), argmax_row(0)])
    r = mars_greedy(drafts, lg, theta=0.5)
    assert r.num_accepted.tolist() == [2] and r.next_token.tolist() == [0]
    assert r.relaxable.tolist() == [[True, True]]
    assert r.relaxed.tolist() == [[False, False]]


def test_mars_greedy_relaxed_then_correction_after_later_rejection():
    drafts = L([[3, 9, 1]])
    lg = logits_of(
        [close_call(2, 3, ratio=0.9), close_call(4, 5, ratio=0.9), argmax_row(1), argmax_row(0)]
    )
    r = mars_greedy(drafts, lg, theta=0.8)
    assert r.num_accepted.tolist() == [1]
    assert r.next_token.tolist() == [4]
    # relaxed marks accepted drafts only; relaxable is a property of the position
    assert r.relaxed.tolist() == [[True, False, False]]
    assert r.relaxable.tolist() == [[True, True, False]]


@pytest.mark.parametrize(("z1", "z2"), [(-1.0, -1.05), (0.0, -0.05), (-3.0, -3.0)])
def test_non_positive_top1_never_relaxable_under_logit_ratio(z1, z2):
    # the raw ratio z2 / z1 would be >= 1 (or undefined) here, yet the position is not relaxable
    lg = logits_of([row({2: z1, 3: z2}, fill=-20.0), argmax_row(8)])
    drafts = L([[3]])
    for theta in (-5.0, 0.0, 0.9):
        r = mars_greedy(drafts, lg, theta=theta, margin=LOGIT_RATIO)
        assert never_relaxable(float(r.statistic[0, 0]))
        assert r.relaxable.tolist() == [[False]]
        assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([0], [2])
    # the same position is relaxable under prob-ratio: exp(z2 - z1) >= exp(-0.05) > 0.9
    r = mars_greedy(drafts, lg, theta=0.9, margin=PROB_RATIO)
    assert float(r.statistic[0, 0]) == pytest.approx(math.exp(z2 - z1))
    assert r.relaxable.tolist() == [[True]]
    assert r.relaxed.tolist() == [[True]]
    assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([1], [8])


def test_logit_ratio_small_positive_top1_with_negative_top2():
    # z1 > 0, z2 < 0: the ratio is negative; a negative theta can relax it (paper's formula)
    lg = logits_of([row({2: 2.0, 3: -1.0}, fill=-20.0), argmax_row(8)])
    r = mars_greedy(L([[3]]), lg, theta=-0.6)
    assert float(r.statistic[0, 0]) == pytest.approx(-0.5)
    assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[True]]
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
        assert r.statistic.tolist() == [[1.0]]
        assert (r.num_accepted.tolist(), r.next_token.tolist()) == ([1], [8])
        assert r.relaxed.tolist() == [[True]]
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
            assert r.relaxable.tolist() == [[False]]
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
    assert r.relaxable.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    assert r.relaxed.tolist() == [[True] * 3, [True, False, False], [False] * 3]
    # the statistic is reported for every position, padded or not
    assert r.statistic.flatten().tolist() == pytest.approx([0.9] * 9)


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
    assert r.statistic.tolist() == [[NOT_RELAXABLE]]  # strict_greedy computes no statistic
    r = verify(L([[3]]), lg, rule=rule_from_theta(0.5, PROB_RATIO))
    assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[True]]


def test_zero_drafts_emit_target_token():
    lg = logits_of([argmax_row(6)])
    drafts = torch.zeros(1, 0, dtype=torch.long)
    for r in (strict_greedy(drafts, lg), mars_greedy(drafts, lg, 0.5)):
        assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [6]
        assert r.relaxed.shape == (1, 0)
    r = speculative_sampling(
        drafts, lg, torch.zeros(1, 0), torch.tensor([0.5]), temperature=1.0, top_k=1
    )
    assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [6]


# ---------------------------------------- greedy properties

# a coarse grid makes ties and z1 <= 0 common; a few continuous values and -inf mixed in
grid_logit = st.sampled_from([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
any_logit = st.one_of(grid_logit, grid_logit, grid_logit, st.floats(-6, 6, width=32), st.just(NINF))
GREEDY_THETAS = [-0.5, 0.0, 0.3, 0.5, 0.7, 0.9, 1.0, INF]


@st.composite
def greedy_case(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(0, 4))
    lg = draw(st.lists(st.lists(st.lists(any_logit, min_size=V, max_size=V), min_size=K + 1,
                                max_size=K + 1), min_size=B, max_size=B))
    lg = torch.tensor(lg, dtype=torch.float32)
    # drafts biased towards the target's top-2 so that acceptance is common
    z1, z2, t1, t2 = top2(lg[:, :K])
    choice = draw(st.lists(st.lists(st.integers(0, V + 1), min_size=K, max_size=K),
                           min_size=B, max_size=B))
    c = torch.tensor(choice, dtype=torch.long).reshape(B, K)
    drafts = torch.where(c == V, t1, torch.where(c == V + 1, t2, c.clamp(max=V - 1)))
    dl = L(draw(st.lists(st.integers(0, K), min_size=B, max_size=B)))
    use_dl = draw(st.booleans())
    return drafts, lg, (dl if use_dl else None)


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


def ref_mars_greedy_row(drafts, lg, theta, margin, n_real):
    """Algorithm 1 for one row, straight from the rules (lists in, (n, next, relaxed) out)."""
    relaxed = [False] * len(drafts)
    for i in range(n_real):
        z = lg[i]
        t1, t2, z1, z2 = ref_top2(z)
        relaxable = ref_stat(z1, z2, margin) > theta
        if drafts[i] == t1:
            continue
        if drafts[i] == t2 and relaxable:
            relaxed[i] = True
            continue
        return i, t1, relaxed
    return n_real, ref_top2(lg[n_real])[0], relaxed


@HYP
@given(greedy_case(), st.sampled_from(GREEDY_THETAS), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_mars_greedy_matches_reference(case, theta, margin):
    drafts, lg, dl = case
    if margin == PROB_RATIO and theta < 0:
        theta = 0.0  # stat = 0 at z2 = -inf: theta < 0 would relax a row's -inf top-2 token
    B, K = drafts.shape
    r = mars_greedy(drafts, lg, theta, margin, dl)
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        n, nxt, relaxed = ref_mars_greedy_row(
            drafts[b].tolist(), lg[b].tolist(), theta, margin, n_real
        )
        assert int(r.num_accepted[b]) == n
        assert int(r.next_token[b]) == nxt
        assert r.relaxed[b].tolist() == relaxed
        for i in range(K):
            z1, z2 = ref_top2(lg[b, i].tolist())[2:]
            stat = ref_stat(z1, z2, margin)
            got = float(r.statistic[b, i])
            if stat == NOT_RELAXABLE:
                assert never_relaxable(got)
            else:
                assert got == pytest.approx(stat, rel=1e-6)
            assert bool(r.relaxable[b, i]) == (stat > theta and i < n_real)


@HYP
@given(greedy_case(), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_theta_inf_mars_greedy_is_strict(case, margin):
    drafts, lg, dl = case
    s = strict_greedy(drafts, lg, dl)
    r = mars_greedy(drafts, lg, INF, margin, dl)
    assert torch.equal(r.num_accepted, s.num_accepted)
    assert torch.equal(r.next_token, s.next_token)
    assert torch.equal(r.relaxed, s.relaxed) and not r.relaxed.any()
    assert torch.equal(r.relaxable, s.relaxable) and not r.relaxable.any()
    # strict greedy = transformers' argmax rule
    B, K = drafts.shape
    am = lg.argmax(-1)
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        n = 0
        while n < n_real and int(drafts[b, n]) == int(am[b, n]):
            n += 1
        assert int(s.num_accepted[b]) == n and int(s.next_token[b]) == int(am[b, n])


@HYP
@given(greedy_case(), st.sampled_from([LOGIT_RATIO, PROB_RATIO]))
def test_property_mars_greedy_monotone_in_theta_and_rows_independent(case, margin):
    drafts, lg, dl = case
    prev = None
    for theta in (INF, 0.9, 0.5, 0.0):
        r = mars_greedy(drafts, lg, theta, margin, dl)
        if prev is not None:
            assert (r.num_accepted >= prev).all()  # a lower threshold never accepts less
        prev = r.num_accepted
    r = mars_greedy(drafts, lg, 0.5, margin, dl)
    for b in range(drafts.shape[0]):
        dlb = None if dl is None else dl[b : b + 1]
        alone = mars_greedy(drafts[b : b + 1], lg[b : b + 1], 0.5, margin, dlb)
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


# ---------------------------------------- sampling: branches


def sample_one(drafts, lg, u_acc, u_s, **kw) -> VerifyResult:
    return speculative_sampling(
        L([drafts]), lg, torch.tensor([u_acc], dtype=torch.float32),
        torch.tensor([u_s], dtype=torch.float32), **kw
    )


def test_strict_sampling_accept_probability_one_hot_q():
    lg = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1] + [1e-9] * 6, [0.1] * 10]]))
    # draft 1 has p = 0.3: accepted iff u < 0.3
    assert sample_one([1], lg, [0.29], 0.5, temperature=1.0).num_accepted.tolist() == [1]
    r = sample_one([1], lg, [0.31], 0.0, temperature=1.0)
    assert r.num_accepted.tolist() == [0]
    # the correction comes from the residual: p without token 1, renormalised
    # residual ~ (0.4, 0, 0.2, 0.1, ...)/0.7: u = 0.58 -> cdf .571 at 0, .857 at 2 -> token 2
    r = sample_one([1], lg, [0.31], 0.58, temperature=1.0)
    assert r.next_token.tolist() == [2]
    r = sample_one([1], lg, [0.31], 0.56, temperature=1.0)
    assert r.next_token.tolist() == [0]
    for u_s in torch.linspace(0, 0.999, 50).tolist():
        assert sample_one([1], lg, [0.9], u_s, temperature=1.0).next_token.tolist() != [1]


def test_strict_sampling_accept_probability_real_q():
    lg = torch.log(torch.tensor([[[0.4, 0.3, 0.2, 0.1] + [1e-9] * 6, [0.1] * 10]]))
    q = torch.tensor([[[0.1, 0.6, 0.2, 0.1] + [0.0] * 6]])
    # p/q at token 1 = 0.5
    r = sample_one([1], lg, [0.49], 0.5, temperature=1.0, draft_probs=q)
    assert r.num_accepted.tolist() == [1]
    r = sample_one([1], lg, [0.51], 0.5, temperature=1.0, draft_probs=q)
    assert r.num_accepted.tolist() == [0]
    # residual max(0, p - q) = (0.3, 0, 0, 0, tiny...): token 0 (nearly always)
    assert r.next_token.tolist() == [0]
    # p >= q: always accepted
    r = sample_one([0], lg, [0.9999], 0.5, temperature=1.0, draft_probs=q)
    assert r.num_accepted.tolist() == [1]


def test_float64_uniform_near_one_still_accepts_certain_draft():
    lg = torch.tensor([[row({3: 100.0}, fill=0.0), row({8: 100.0}, fill=0.0)]])  # p(3) = 1
    u = torch.tensor([[1.0 - 1e-9]], dtype=torch.float64)
    r = speculative_sampling(L([[3]]), lg, u, torch.tensor([0.5], dtype=torch.float64),
                             temperature=1.0)
    # got: num_accepted 0 and a correction drawn from a residual of mass ~1e-43 (token 5)
    assert r.num_accepted.tolist() == [1] and r.next_token.tolist() == [8]


def test_strict_sampling_bonus_from_p_after_all_accepted():
    lg = torch.log(torch.tensor([[[0.5, 0.5] + [1e-12] * 8, [0.0] * 9 + [1.0]]]) + 1e-30)
    r = sample_one([0], lg, [0.1], 0.3, temperature=1.0)
    assert r.num_accepted.tolist() == [1] and r.next_token.tolist() == [9]


def test_filtered_draft_never_accepted_strict():
    lg = torch.tensor([[row({0: 3.0, 1: 2.9, 2: 2.8, 5: 2.7}, fill=0.0), row({}, fill=0.0)]])
    for draft in (2, 5, 9):
        for u in (0.0, 0.5):
            for q in (None, torch.full((1, 1, V), 0.1)):
                r = sample_one([draft], lg, [u], 0.5, temperature=1.0, top_k=2, draft_probs=q)
                assert r.num_accepted.tolist() == [0]
                assert r.next_token.tolist()[0] in (0, 1)


def test_mars_sampling_branches():
    # position 0: top-1 = 2 (z 4.0), top-2 = 3 (z 3.6): logit ratio 0.9; position 1 uniform
    lg = torch.tensor([[row({2: 4.0, 3: 3.6, 6: 3.0}, fill=0.0), row({}, fill=0.0)]])
    p0 = torch.softmax(lg[0, 0], -1)
    kw = dict(temperature=1.0, theta=0.8)
    # top-2 accepted for any uniform; relaxed only where strict would have rejected
    for u in (0.0, float(p0[3]) - 1e-3, float(p0[3]) + 1e-3, 0.999):
        r = sample_one([3], lg, [u], 0.5, **kw)
        assert r.num_accepted.tolist() == [1]
        assert r.relaxable.tolist() == [[True]]
        assert r.relaxed.tolist() == [[u >= float(p0[3])]]
    # top-1 too: relaxed where strict rejection sampling would have rejected it
    for u in (0.1, 0.99):
        r = sample_one([2], lg, [u], 0.5, **kw)
        assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[u >= float(p0[2])]]
    # top-3 rejected at a relaxable position even when strict would have accepted (u = 0)
    r = sample_one([6], lg, [0.0], 0.5, **kw)
    assert r.num_accepted.tolist() == [0] and not r.relaxed.any()
    # ... and the correction is drawn from p itself (may return the rejected draft)
    cdf = p0.double().cumsum(0)
    u_mid = float((cdf[5] + cdf[6]) / 2)  # inside token 6's interval
    r = sample_one([6], lg, [0.0], u_mid, **kw)
    assert r.next_token.tolist() == [6]
    # the same step strictly (theta = inf): accepted at u = 0, and never re-emits 6 on rejection
    r = sample_one([6], lg, [0.0], u_mid, temperature=1.0)
    assert r.num_accepted.tolist() == [1]
    r = sample_one([6], lg, [0.999], u_mid, temperature=1.0)
    assert r.num_accepted.tolist() == [0] and r.next_token.tolist() != [6]
    # statistic reported from the raw logits
    assert float(r.statistic[0, 0]) == pytest.approx(0.9)


def test_mars_sampling_statistic_from_raw_logits_not_tempered():
    # prob-ratio on raw logits exp(-0.3) = 0.741 > 0.7, on logits / 0.5 it would be 0.549
    lg = torch.tensor([[row({2: 1.0, 3: 0.7}, fill=-5.0), row({}, fill=0.0)]])
    for t in (0.5, 1.0, 2.0):
        r = sample_one([3], lg, [0.999], 0.5, temperature=t, theta=0.7, margin=PROB_RATIO)
        assert float(r.statistic[0, 0]) == pytest.approx(math.exp(-0.3), rel=1e-5)
        assert r.relaxable.tolist() == [[True]] and r.num_accepted.tolist() == [1]


def test_mars_sampling_z1_non_positive_not_relaxable():
    lg = torch.tensor([[row({2: -1.0, 3: -1.01}, fill=-9.0), row({}, fill=0.0)]])
    r = sample_one([3], lg, [0.999], 0.5, temperature=1.0, theta=0.5, margin=LOGIT_RATIO)
    assert r.relaxable.tolist() == [[False]] and r.num_accepted.tolist() == [0]
    r = sample_one([3], lg, [0.999], 0.5, temperature=1.0, theta=0.5, margin=PROB_RATIO)
    assert r.relaxable.tolist() == [[True]] and r.num_accepted.tolist() == [1]


def test_mars_sampling_filtered_top2_never_accepted():
    # a tie z1 == z2 would be kept by top-k = 1; make top-2 strictly lower so top-k removes it
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0), row({}, fill=0.0)]])
    for u in (0.0, 0.5, 0.999):
        for margin in (LOGIT_RATIO, PROB_RATIO):
            r = sample_one([3], lg, [u], u, temperature=1.0, top_k=1, theta=0.5, margin=margin)
            assert r.relaxable.tolist() == [[True]]
            assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [2]
            r = sample_one([3], lg, [u], u, temperature=1.0, top_p=0.3, theta=0.5, margin=margin)
            assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [2]


def test_draft_len_padding_sampling():
    K = 3
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0)] * K + [row({7: 9.0})]] * 3)
    drafts = L([[2, 2, 2]] * 3)
    dl = L([3, 1, 0])
    for theta in (INF, 0.5):
        r = speculative_sampling(drafts, lg, torch.zeros(3, K), torch.full((3,), 0.5),
                                 temperature=1.0, theta=theta, draft_len=dl)
        assert r.num_accepted.tolist() == [3, 1, 0]
        # bonus from the row after the last real draft; u = 0.5 picks token 2 there
        assert r.next_token.tolist() == [7, 2, 2]
        if theta == 0.5:
            assert r.relaxable.tolist() == [[True] * 3, [True, False, False], [False] * 3]
        assert not r.relaxed.any()
    # a padded slot is never accepted even when it would be with probability 1
    lg1 = torch.tensor([[row({4: 50.0})] * 2])
    r = speculative_sampling(L([[4]]), lg1, torch.zeros(1, 1), torch.tensor([0.3]),
                             temperature=1.0, draft_len=L([0]))
    assert r.num_accepted.tolist() == [0] and r.next_token.tolist() == [4]


def test_verify_dispatch_sampling_and_shape_errors():
    lg = torch.tensor([[row({2: 4.0, 3: 3.9}, fill=0.0), row({}, fill=0.0)]])
    with pytest.raises(AssertionError, match="uniforms"):
        verify(L([[3]]), lg, rule=rule_from_theta(0.5), temperature=1.0)
    r = verify(L([[3]]), lg, rule=rule_from_theta(0.5), temperature=1.0, u_accept=torch.tensor([[0.99]]),
               u_sample=torch.tensor([0.5]))
    assert r.num_accepted.tolist() == [1] and r.relaxed.tolist() == [[True]]


# ---------------------------------------- sampling: reference


def ref_spec_row(drafts, lg, u_acc, u_s, *, temperature, top_k, top_p, q, theta, margin, n_real):
    """One row of strict/MARS speculative sampling written from the rules.

    Returns (n accepted, distribution of the next token, relaxed flags)."""
    p = sampling_probs(lg.unsqueeze(0), temperature, top_k, top_p)[0]  # [K+1, V]
    relaxed = [False] * len(drafts)
    for i in range(n_real):
        x = drafts[i]
        t1, t2, z1, z2 = ref_top2(lg[i].tolist())
        px = p[i, x]
        qx = torch.tensor(1.0) if q is None else q[i, x]
        strict_ok = float(px) > 0 and u_acc[i] < float((px / qx.clamp(min=1e-30)).clamp(max=1.0))
        if ref_stat(z1, z2, margin) > theta:  # relaxable: top-1/top-2 in, else p
            if x in (t1, t2) and float(px) > 0:
                relaxed[i] = not strict_ok
                continue
            return i, p[i], relaxed
        if strict_ok:
            continue
        if q is None:
            res = p[i].clone()
            res[x] = 0.0
        else:
            res = (p[i] - q[i]).clamp(min=0.0)
        return i, (res / res.sum() if float(res.sum()) > 0 else p[i]), relaxed
    return n_real, p[n_real], relaxed


def near_boundary(dist: torch.Tensor, u: float, tol: float = 1e-5) -> bool:
    cdf = dist.double().cumsum(0)
    return bool(((cdf / cdf[-1] - u).abs() < tol).any())


@st.composite
def sampling_case(draw):
    B = draw(st.integers(1, 3))
    K = draw(st.integers(0, 4))
    lg = draw(st.lists(st.lists(st.lists(any_logit, min_size=V, max_size=V).filter(
        lambda r: any(math.isfinite(z) for z in r)), min_size=K + 1, max_size=K + 1),
        min_size=B, max_size=B))
    lg = torch.tensor(lg, dtype=torch.float32)
    use_q = draw(st.booleans())
    q = None
    if use_q:
        ql = draw(st.lists(st.floats(-4, 4), min_size=B * K * V, max_size=B * K * V))
        q = torch.softmax(torch.tensor(ql, dtype=torch.float32).reshape(B, K, V), -1)
    _, _, t1, t2 = top2(lg[:, :K])
    choice = torch.tensor(draw(st.lists(st.integers(0, V + 1), min_size=B * K, max_size=B * K)),
                          dtype=torch.long).reshape(B, K)
    drafts = torch.where(choice == V, t1, torch.where(choice == V + 1, t2, choice.clamp(max=V - 1)))
    unif = st.floats(0.0, 1.0, exclude_max=True, width=32)
    u_acc = torch.tensor(draw(st.lists(unif, min_size=B * K, max_size=B * K)),
                         dtype=torch.float32).reshape(B, K)
    u_s = torch.tensor(draw(st.lists(unif, min_size=B, max_size=B)), dtype=torch.float32)
    dl = L(draw(st.lists(st.integers(0, K), min_size=B, max_size=B)))
    dl = dl if draw(st.booleans()) else None
    params = dict(
        temperature=draw(st.sampled_from([0.5, 1.0, 2.0])),
        top_k=draw(st.sampled_from([0, 1, 2, 3, V])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.5, 0.2])),
        theta=draw(st.sampled_from([INF, 0.0, 0.3, 0.6, 0.9])),
        margin=draw(st.sampled_from([LOGIT_RATIO, PROB_RATIO])),
    )
    return drafts, lg, u_acc, u_s, q, dl, params


@HYP_SLOW
@given(sampling_case())
def test_property_speculative_sampling_matches_reference(case):
    drafts, lg, u_acc, u_s, q, dl, params = case
    B, K = drafts.shape
    r = speculative_sampling(drafts, lg, u_acc, u_s, draft_probs=q, draft_len=dl, **params)
    for b in range(B):
        n_real = K if dl is None else int(dl[b])
        n, dist, relaxed = ref_spec_row(
            drafts[b].tolist(), lg[b], u_acc[b].tolist(), float(u_s[b]),
            q=None if q is None else q[b], n_real=n_real, **params,
        )
        assert int(r.num_accepted[b]) == n
        assert r.relaxed[b].tolist() == relaxed
        nxt = int(r.next_token[b])
        assert float(dist[nxt]) > 0
        want = int(sample_from(dist.unsqueeze(0), u_s[b : b + 1]))
        assert nxt == want or near_boundary(dist, float(u_s[b]))
        # rows are independent
        alone = speculative_sampling(
            drafts[b : b + 1], lg[b : b + 1], u_acc[b : b + 1], u_s[b : b + 1],
            draft_probs=None if q is None else q[b : b + 1],
            draft_len=None if dl is None else dl[b : b + 1], **params,
        )
        assert_same_result(result_row(r, b), alone)
    if math.isinf(params["theta"]):
        assert not r.relaxable.any() and not r.relaxed.any()
    assert not (r.relaxed & ~r.relaxable).any()


@HYP_SLOW
@given(sampling_case())
def test_property_theta_inf_sampling_ignores_margin(case):
    drafts, lg, u_acc, u_s, q, dl, params = case
    params = {**params, "theta": INF}
    a = speculative_sampling(drafts, lg, u_acc, u_s, draft_probs=q, draft_len=dl,
                             **{**params, "margin": LOGIT_RATIO})
    b = speculative_sampling(drafts, lg, u_acc, u_s, draft_probs=q, draft_len=dl,
                             **{**params, "margin": PROB_RATIO})
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert not a.relaxed.any() and not b.relaxed.any()


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


def run_strict(n: int, K: int, seed: int, *, real_q: bool = False, always_accept: bool = False,
               theta: float = INF, logits: torch.Tensor | None = None, drafts_row=None, **kw):
    """n rows of one step at once; each row has its own uniforms from one seeded generator."""
    g = gen(seed)
    lg = (TARGET if logits is None else logits)[: K + 1].unsqueeze(0).expand(n, -1, -1)
    q = None
    if real_q:
        # a drafter far from the target: reversed probabilities
        q = P_TARGET[:K].flip(-1).unsqueeze(0).expand(n, -1, -1).contiguous()
        u_draft = torch.rand(n, K, generator=g)
        drafts = torch.stack([sample_from(q[:, i], u_draft[:, i]) for i in range(K)], dim=1)
    else:
        d = (ONE_HOT_DRAFTS if drafts_row is None else drafts_row)[:K]
        drafts = L(d).unsqueeze(0).expand(n, -1)
    u_acc = torch.rand(n, K, generator=g)
    if always_accept:
        u_acc = torch.zeros(n, K)
    u_s = torch.rand(n, generator=g)
    r = speculative_sampling(drafts, lg, u_acc, u_s, temperature=kw.pop("temperature", 1.0),
                             draft_probs=q, theta=theta, **kw)
    return r, drafts


@pytest.mark.parametrize("K", [1, 3])
@pytest.mark.parametrize("real_q", [False, True])
def test_strict_sampling_reproduces_target(K, real_q):
    N = 20_000
    r, drafts = run_strict(N, K, seed=11 + K, real_q=real_q)
    tok0, _ = token_at(r, drafts, 0)
    assert tv(tok0, P_TARGET[0]) < tv_bound(N)
    # acceptance rate of the first draft: sum_x min(p, q) (one-hot q: p(d0))
    q0 = P_TARGET[0].flip(-1) if real_q else torch.nn.functional.one_hot(L(ONE_HOT_DRAFTS[0]), V)
    rate = float(torch.minimum(P_TARGET[0], q0).sum())
    acc = float((r.num_accepted >= 1).double().mean())
    assert abs(acc - rate) < 5 * math.sqrt(rate * (1 - rate) / N)
    # later positions: given the step reached position i, the token there ~ p_i
    for pos in range(1, K + 1):
        tok, reached = token_at(r, drafts, pos)
        m = int(reached.sum())
        assert m > 200
        assert tv(tok, P_TARGET[pos]) < tv_bound(m), pos


def test_strict_sampling_tv_shrinks_with_samples():
    for real_q in (False, True):
        tvs = []
        for n in (2_000, 50_000):
            r, drafts = run_strict(n, 3, seed=5, real_q=real_q)
            t = tv(token_at(r, drafts, 0)[0], P_TARGET[0])
            assert t < tv_bound(n)
            tvs.append(t)
        assert tvs[1] < tvs[0] / 2, tvs  # ~ 1/sqrt(N): expected ratio 5


def test_strict_sampling_with_filtering_reproduces_filtered_target():
    N = 20_000
    for kw in (dict(top_k=3), dict(top_p=0.6), dict(temperature=0.6, top_k=5, top_p=0.9)):
        # draft 3 is kept by these filters at position 0; draft 9 at position 1 is not
        r, drafts = run_strict(N, 2, seed=21, drafts_row=[3, 9], **dict(kw))
        p = sampling_probs(TARGET, kw.get("temperature", 1.0), kw.get("top_k", 0),
                           kw.get("top_p", 1.0))
        tok0, _ = token_at(r, drafts, 0)
        assert tv(tok0, p[0]) < tv_bound(N)
        assert (p[0][tok0] > 0).all()
        tok1, reached = token_at(r, drafts, 1)
        assert tv(tok1, p[1]) < tv_bound(int(reached.sum()))
        assert (r.num_accepted < 2).all()  # the filtered draft is never accepted


def broken_residual(p, q, draft):
    return p


@pytest.mark.parametrize("real_q", [False, True])
def test_negative_control_correction_from_p_fails(monkeypatch, real_q):
    """Drawing the correction from p instead of the residual biases towards the draft."""
    r, drafts = run_strict(20_000, 1, seed=3, real_q=real_q)
    good = tv(token_at(r, drafts, 0)[0], P_TARGET[0])
    monkeypatch.setattr(mv, "residual", broken_residual)
    for n in (2_000, 20_000, 50_000):
        r, drafts = run_strict(n, 1, seed=3, real_q=real_q)
        bad = tv(token_at(r, drafts, 0)[0], P_TARGET[0])
        assert bad > tv_bound(n), (n, bad)
    assert good < tv_bound(20_000) < bad


def test_negative_control_always_accept_fails():
    for real_q in (False, True):
        for n in (2_000, 20_000):
            r, drafts = run_strict(n, 1, seed=4, real_q=real_q, always_accept=True)
            bad = tv(token_at(r, drafts, 0)[0], P_TARGET[0])
            assert bad > tv_bound(n), (real_q, n, bad)


# MARS: position 0 is a close call (logit ratio 0.95 between tokens 1 and 3)
MARS_LOGITS = torch.stack([
    torch.tensor([1.0, 4.0, 0.5, 3.8, 2.5, 0.0, 2.0, -1.0, 1.5, 0.2]),
    TARGET[1] + 3.0,
    TARGET[2] + 3.0,
    TARGET[3] + 3.0,
])


def mars_law(p: torch.Tensor, draft: int, relaxable: bool, t1: int, t2: int, q=None):
    """Analytic law of the token a MARS step emits at one position (one-hot q unless q)."""
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
        (4, 0.9, {}),  # top-3 at a relaxable position: law p (not the residual)
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
    r, drafts = run_strict(N, 2, seed=31 + draft, logits=MARS_LOGITS, drafts_row=[draft, 2],
                           theta=theta, **dict(kw))
    p = sampling_probs(MARS_LOGITS, temperature, kw.get("top_k", 0), kw.get("top_p", 1.0))
    relaxable = 0.95 > theta
    assert r.relaxable[:, 0].all() == relaxable
    law0 = mars_law(p[0], draft, relaxable, 1, 3)
    tok0, _ = token_at(r, drafts, 0)
    assert tv(tok0, law0) < tv_bound(N)
    assert (p[0][tok0] > 0).all()
    if relaxable and draft in (1, 3) and p[0, draft] > 0:
        assert (r.num_accepted >= 1).all()
        # relaxed exactly where strict rejection (u >= p(x)) would have rejected
        assert 0 < float(r.relaxed[:, 0].double().mean()) < 1
    if relaxable and not (draft in (1, 3) and p[0, draft] > 0):
        assert (r.num_accepted == 0).all()
        if p[0, draft] > 0:
            # corrections re-emit the rejected draft at rate p(x): drawn from p, not a residual
            rate = float((tok0 == draft).double().mean())
            assert abs(rate - float(p[0, draft])) < 5 * math.sqrt(float(p[0, draft]) / N)
    # position 1 (logit ratio 0.8 / non-relaxable at theta >= 0.9): strict, law p_1
    tok1, reached = token_at(r, drafts, 1)
    if int(reached.sum()) > 500:
        assert tv(tok1, p[1]) < tv_bound(int(reached.sum()))
    assert not r.relaxable[:, 1].any()


def test_mars_sampling_analytic_law_with_real_q():
    N = 30_000
    g = gen(99)
    p = torch.softmax(MARS_LOGITS, -1)
    q0 = torch.softmax(torch.tensor([0.0, 0.5, 0.5, 2.5, 1.5, -1.0, 0.3, 0.0, 0.0, 2.0]), -1)
    q = torch.stack([q0, P_TARGET[1].flip(-1)]).unsqueeze(0).expand(N, -1, -1).contiguous()
    drafts = torch.stack([sample_from(q[:, i], torch.rand(N, generator=g)) for i in range(2)], 1)
    u_acc = torch.rand(N, 2, generator=g)
    u_s = torch.rand(N, generator=g)
    lg = MARS_LOGITS[:3].unsqueeze(0).expand(N, -1, -1)
    r = speculative_sampling(drafts, lg, u_acc, u_s, temperature=1.0, draft_probs=q, theta=0.9)
    tok0, _ = token_at(r, drafts, 0)
    law0 = mars_law(p[0], -1, True, 1, 3, q=q0)
    assert tv(tok0, law0) < tv_bound(N)
    # the MARS law is not the target's, and the test can tell them apart
    assert 0.5 * float((law0 - p[0]).abs().sum()) > 3 * tv_bound(N)
    assert tv(tok0, p[0]) > tv_bound(N)
    tok1, reached = token_at(r, drafts, 1)
    assert tv(tok1, p[1]) < tv_bound(int(reached.sum()))
    # the acceptance rate at the relaxable position is q(top-1) + q(top-2)
    rate = float(q0[1] + q0[3])
    assert abs(float((r.num_accepted >= 1).double().mean()) - rate) < 5 * math.sqrt(rate / N)


def test_mars_sampling_with_theta_inf_is_strict_in_law_and_per_sample():
    N = 20_000
    a, drafts = run_strict(N, 2, seed=8, logits=MARS_LOGITS, drafts_row=[3, 2])
    b, _ = run_strict(N, 2, seed=8, logits=MARS_LOGITS, drafts_row=[3, 2], theta=INF,
                      margin=PROB_RATIO)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    p = torch.softmax(MARS_LOGITS, -1)
    assert tv(token_at(a, drafts, 0)[0], p[0]) < tv_bound(N)


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
    u_acc, u_s = torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(AssertionError, match="do not match"):
        speculative_sampling(good, torch.zeros(2, 5, V), u_acc, u_s, temperature=1.0)
    with pytest.raises(AssertionError, match="draft_probs"):
        speculative_sampling(good, lg, u_acc, u_s, temperature=1.0,
                             draft_probs=torch.full((2, 3, V + 1), 0.1))
    with pytest.raises(AssertionError, match="draft_probs"):
        speculative_sampling(good, lg, u_acc, u_s, temperature=1.0,
                             draft_probs=torch.full((2, 4, V), 0.1))
    with pytest.raises(AssertionError, match="do not match"):
        verify(good, torch.zeros(2, 3, V), rule=rule_from_theta(0.5), temperature=1.0, u_accept=u_acc,
               u_sample=u_s)
