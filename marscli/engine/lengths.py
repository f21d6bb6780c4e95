"""The draft-length policy of one step: every row's k, from the rows' offers and the
measured step costs (marscli.engine.costs).

A record's text is defined position by position from its own text (marscli.verification.chain),
so no row's text depends on how many tokens a step drafts: every row follows the batch's
measured costs, and a step may draft nothing at all (a plain step, with no speculative
overhead beyond the drafter's proposal for the next position where a relaxed rule judges it).

The exception is a row whose text does depend on its chain: the paper's Algorithm 1
(``relax_at="drafted"``), and a relaxed rule with an EAGLE-3 head or a draft tree (their
chain tokens past the first are not the drafter's proposals for their positions). Those rows
draft a fixed K, all they have (``fixed``): their text is then a function of the record and
its settings, K included.
"""

from __future__ import annotations

from collections.abc import Sequence

from marscli.drafters.base import DraftOffer, choose_draft_lengths


def step_lengths(offers: Sequence[DraftOffer], caps: Sequence[int], costs, batch: int, *,
                 adaptive: bool = True, fixed: bool = False, left: Sequence[int] | None = None,
                 bonus_drafts: int = 0) -> list[int]:
    """Every row's draft length this step, at most its cap.

    costs: a StepCosts (``target(B, n)``, ``draft(B, k)``) of the engine's steps at ``batch``
    rows. left: when no record waits for a free row (the job is drained), the tokens each row
    has left to generate: the step then buys progress towards the end of the job, the end of
    the rows with the most left (choose_draft_lengths' ``critical``). bonus_drafts: draft
    positions a paid drafter runs beyond the k drafts (1 when a relaxed rule judges the
    position after them: a draft model proposes it too). fixed or not adaptive: every row
    drafts all it has (a fixed K)."""
    if fixed or not adaptive:
        chosen = choose_draft_lengths(offers, lambda L: 1.0, adaptive=False)
    else:
        critical = None
        if left is not None and len(offers) > 1:
            most = max(left)
            critical = [n == most for n in left]
        chosen = choose_draft_lengths(
            offers, lambda L: costs.target(batch, L + 1) + costs.draft(batch, L + bonus_drafts),
            True, critical, lambda L: costs.draft(batch, L + bonus_drafts))
    return [max(min(k, cap), 0) for k, cap in zip(chosen, caps)]
