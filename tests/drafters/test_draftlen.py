"""The draft-length policy: per step, every row's k from acceptance estimates and step costs.

Synthetic cost curves stand for the machines: a flat one (a GPU before it is compute bound:
drafting is free), a steep one (a loaded CPU at a large batch: every padded token costs),
and the CPU-like curve where only long drafts cost.
"""

from __future__ import annotations

import pytest

from marscli.drafters.base import (
    PROBE_AFTER_STEPS,
    AcceptanceTracker,
    DraftOffer,
    choose_draft_lengths,
    expected_tokens,
)
from marscli.drafters.ngram import NgramDrafter
from marscli.engine.costs import StepCosts, static_costs


def flat(L: int) -> float:
    return 1.0


def steep(L: int) -> float:  # every drafted position costs 60 % of a one-token step
    return 1.0 + 0.6 * L


def test_expected_tokens_is_the_geometric_sum():
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == pytest.approx(5.0, rel=1e-2)  # clipped just below 1


def test_drafts_where_it_pays_and_not_where_it_does_not():
    good = [DraftOffer(8, 0.9)]
    bad = [DraftOffer(8, 0.05)]
    # Free drafting: a good drafter drafts everything it has.
    assert choose_draft_lengths(good, flat) == [8]
    # Steep costs and a poor drafter: decode plainly.
    assert choose_draft_lengths(bad, steep) == [0]
    # Steep costs, a good drafter: some drafts, but not all 8 (a^k falls while costs grow).
    k = choose_draft_lengths(good, steep)[0]
    assert 1 <= k < 8
    rates = {L: expected_tokens(0.9, L) / steep(L) for L in range(9)}
    assert rates[k] == max(rates.values())


def test_flat_costs_never_pay_for_nothing():
    # Even when drafting is free, an estimate of 0 gains nothing: ties go to the plain step.
    assert choose_draft_lengths([DraftOffer(8, 0.0)], flat) == [0]


def test_rows_without_a_match_do_not_draft_and_others_are_capped():
    offers = [DraftOffer(0), DraftOffer(3, 0.95), DraftOffer(8, 0.95)]
    assert choose_draft_lengths(offers, flat) == [0, 3, 8]


def test_padding_trade_off_in_a_batch():
    """One eager row among many poor ones: its expected tokens do not pay for padding every
    row of the batch, although it would draft alone."""
    def batch_cost(B):  # a fixed cost, and 3 % of it per token in the forward (padding too)
        return lambda L: 1.0 + 0.03 * B * (L + 1)

    eager = DraftOffer(8, 0.8)
    poor = DraftOffer(8, 0.02)
    alone = choose_draft_lengths([eager], batch_cost(1))
    assert alone[0] >= 3
    batch = choose_draft_lengths([eager] + [poor] * 15, batch_cost(16))
    assert batch == [0] * 16
    # Many eager rows share the padding: the batch drafts again.
    crowd = choose_draft_lengths([eager] * 16, batch_cost(16))
    assert max(crowd) >= 1 and len(set(crowd)) == 1


def test_rows_draft_up_to_the_common_length():
    """Slots up to the step's longest draft are paid for: a poorer row drafts them too."""
    offers = [DraftOffer(8, 0.9), DraftOffer(8, 0.3), DraftOffer(2, 0.3)]
    ks = choose_draft_lengths(offers, lambda L: 1.0 + 0.1 * L)
    L = max(ks)
    assert L >= 2 and ks == [L, L, 2]


def test_fixed_k_ignores_costs():
    offers = [DraftOffer(4, 0.0), DraftOffer(0), DraftOffer(2, 0.5)]
    assert choose_draft_lengths(offers, steep, adaptive=False) == [4, 0, 2]


def test_a_stale_estimate_probes_with_one_draft():
    stale = DraftOffer(8, 0.01, probe=True)
    assert choose_draft_lengths([stale, DraftOffer(8, 0.01)], steep) == [1, 1]
    assert choose_draft_lengths([DraftOffer(0, 0.0, probe=True)], steep) == [0]


def test_drained_queue_aims_at_the_last_row():
    """No record waits: only the rows that may finish last count, by their least progress."""
    eager, poor, none = DraftOffer(8, 0.9), DraftOffer(8, 0.02), DraftOffer(0)
    cheap = lambda L: 1.0 + 0.1 * L  # noqa: E731 - drafting pays for one eager row alone
    assert choose_draft_lengths([eager, none], cheap) != [0, 0]  # goodput: the eager row drafts
    # Both rows may finish last and one of them has nothing to draft: drafting cannot bring
    # the end of the job closer, so the batch decodes plainly.
    assert choose_draft_lengths([eager, none], cheap, critical=[True, True]) == [0, 0]
    # Only the row with nothing to draft may finish last: the same.
    assert choose_draft_lengths([eager, none], cheap, critical=[False, True]) == [0, 0]
    # The eager row is the last one: it drafts, and the others draft up to its length.
    ks = choose_draft_lengths([eager, poor], cheap, critical=[True, False])
    assert ks[0] >= 1 and ks[1] == ks[0]
    # A poor critical row outweighs an eager one (the least progress counts, not the sum).
    assert choose_draft_lengths([eager, poor], cheap, critical=[True, True]) == [0, 0]
    # The critical rows' own drafts bound the length, not a non-critical row's longer ones.
    ks = choose_draft_lengths([DraftOffer(2, 0.99), DraftOffer(8, 0.99)], flat, critical=[True, False])
    assert ks == [2, 2]
    # Stale estimates do not probe once the queue is drained.
    stale = DraftOffer(8, 0.01, probe=True)
    assert choose_draft_lengths([stale, stale], steep, critical=[True, True]) == [0, 0]


def test_tracker_goes_stale_when_it_drafts_nothing():
    t = AcceptanceTracker()
    for _ in range(PROBE_AFTER_STEPS - 1):
        t.update(0, 0)
    assert not t.offer(4).probe
    t.update(0, 0)
    assert t.offer(4).probe
    t.update(1, 1)
    assert not t.offer(4).probe and t.offer(0) == DraftOffer.none()


def test_ngram_learns_from_shadow_drafts():
    """A row that drafts 0 still learns: the match's first token against what was emitted."""
    d = NgramDrafter(4, ngram_max=2, ngram_min=1)
    seq = [5, 6, 7, 8, 5, 6]  # suffix [5, 6] occurred before, followed by 7
    first = d.offer(seq, 4)
    assert first.available == 4 and first.alpha == pytest.approx(0.6)
    d.accepted(0, 0, seq + [9])  # drafted nothing; the target emitted 9, not 7: a miss
    miss = d.offer(seq, 4).alpha
    assert miss < first.alpha
    d.offer(seq, 4)
    d.accepted(0, 0, seq + [7])  # a hit
    assert d.offer(seq, 4).alpha > miss
    # propose() returns what offer() matched, exactly k tokens.
    d.offer(seq, 4)
    assert d.propose(seq, 2).tokens == [7, 8]


def test_ngram_offers_nothing_without_a_match():
    d = NgramDrafter(4)
    assert d.offer([1, 2, 3, 4], 4) == DraftOffer.none()
    assert d.offer([1, 2, 1], 0) == DraftOffer.none()
    assert d.propose([1, 2, 3, 4], 3).tokens == []


def test_policy_on_the_static_cpu_curve():
    """On the CPU curve a good n-gram match drafts at batch 1 and a poor batch of 16 does not."""
    costs = static_costs("cpu")
    one = choose_draft_lengths([DraftOffer(8, 0.7)], lambda L: costs.step(1, L))
    assert one[0] >= 4
    poor = choose_draft_lengths([DraftOffer(8, 0.05)] * 16, lambda L: costs.step(16, L))
    assert poor == [0] * 16


def test_step_costs_interpolate_and_extrapolate():
    c = StepCosts((1, 4), (1, 3), ((1.0, 2.0), (2.0, 6.0)), (0.0, 0.5))
    assert c.target(1, 2) == pytest.approx(1.5)
    assert c.target(1, 5) == pytest.approx(3.0)  # beyond the grid: the last segment's slope
    assert c.target(2, 1) == pytest.approx(1 + (2 - 1) / 3)  # between batch sizes
    assert c.target(8, 1) == pytest.approx(4.0)  # beyond the largest batch: in proportion to B
    assert c.draft(4, 3) == pytest.approx(1.5) and c.draft(4, 0) == 0.0
    assert c.step(4, 2) == pytest.approx(6.0 + 1.0)
    with pytest.raises(ValueError):
        StepCosts((1,), (1,), ((0.0,),), (0.0,))
