"""Hybrid drafting: prompt lookup where it has a match worth taking, the draft model elsewhere.

An n-gram match costs nothing to draft (it copies from the prompt, the output so far, or the
job's finished records); a draft model costs a forward per drafted token but drafts
everywhere. ``HybridDrafter`` holds one of each for a record and, every step, offers the one
whose best chain promises more expected tokens per second:

    rate(source) = max over L of expected_tokens(alpha, L) / seconds(L)

with alpha each source's own acceptance estimate, L up to what it has (the n-gram's match
length, the model's K), and seconds(L) the target forward over L + 1 tokens, plus L draft
forwards for the model. The engine then picks the length as for any drafter; an n-gram offer
is marked ``free`` so that the step pays no drafting for it.

The draft model skips the steps prompt lookup drafts; its cache catches up on the committed
tokens it missed in one forward the next time it drafts (ModelDrafter.propose). The n-gram
side keeps learning while the model drafts: it checks its match's first token against what
was committed (NgramDrafter.accepted's shadow check).

Which curve prices the choice follows the reproducibility contract (docs/verification.md),
as draft lengths do (Engine.draft_lengths): a strict greedy record's text cannot depend on
its drafts, so it uses the engine's measured step costs; a relaxed or sampled record uses the
fixed reference curve (a function of the models only), so its source, like its lengths,
never depends on timings, the batch or its neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from marscli.config import SamplingParams
from marscli.drafters.base import DrafterBase, DraftOffer, Proposal, expected_tokens
from marscli.drafters.kinds import MODEL, NGRAM


class _Flat:
    """Before an engine owns the drafter: every forward costs 1, drafting nothing."""

    def target(self, B: int, n: int) -> float:
        return 1.0

    def step(self, B: int, longest: int) -> float:
        return 1.0


@dataclass
class HybridCosts:
    """What a job's hybrid drafters price their choice with, shared by every row's drafter:
    the engine that runs them (``owner``, set by marscli.engine.scheduler.Engine). Its curves
    are marscli.engine.costs.StepCosts (``target(B, n)``, ``step(B, L)``): its measured
    ``costs`` for a row whose text cannot depend on its drafts (strict greedy), its fixed
    ``reference`` for every other row (Engine.fixed_schedule) and under ``solo_lengths``."""

    owner: Any = None

    def curve(self, sampling: SamplingParams):
        engine = self.owner
        if engine is None:
            return _Flat()
        if engine.solo_lengths or engine.fixed_schedule(sampling):
            return engine.reference
        return engine.costs


def best_rate(offer: DraftOffer, seconds) -> float:
    """The most expected tokens per second any chain length up to offer.available buys
    (L = 0, a plain step, included); seconds(L) is that step's cost."""
    best = 1.0 / seconds(0)
    for L in range(1, max(offer.available, 0) + 1):
        best = max(best, expected_tokens(offer.alpha, L) / seconds(L))
    return best


class HybridDrafter(DrafterBase):
    """One record's drafter: an NgramDrafter and a ModelDrafter, the better one each step."""

    name = "hybrid"

    def __init__(self, ngram, model, costs: HybridCosts):
        self.ngram = ngram
        self.model = model
        self.costs = costs
        self.sampling = SamplingParams()
        self.source = None  # the drafter of the last offer
        #: steps drafted by each source (for tests and narration)
        self.steps = {NGRAM: 0, MODEL: 0}

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.ngram.start(prompt_ids, sampling, generator)
        self.model.start(prompt_ids, sampling, generator)
        self.source = None

    def choose(self, ngram: DraftOffer, model: DraftOffer) -> str:
        """'ngram' or 'model': the source whose best chain buys more tokens per second.
        A stale model estimate (probe) leaves the choice to the n-gram only when its match
        alone beats the model's estimate; ties go to the n-gram (free)."""
        if ngram.available <= 0:
            return MODEL
        if model.available <= 0:
            return NGRAM
        curve = self.costs.curve(self.sampling)
        free = best_rate(ngram, lambda L: curve.target(1, L + 1))
        paid = best_rate(model, lambda L: curve.step(1, L))
        return NGRAM if free >= paid else MODEL

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        if k_max <= 0:
            self.source = None
            return DraftOffer.none()
        g = self.ngram.offer(seq, k_max)
        m = self.model.offer(seq, k_max)
        self.source = self.choose(g, m)
        if self.source == NGRAM:
            return DraftOffer(g.available, g.alpha, g.probe, free=True)
        return m

    def _drafting(self, seq: list[int], k: int) -> str:
        """The source that drafts this step (offered for it if no offer came first), counted."""
        if self.source is None:
            self.offer(seq, k)
        self.steps[self.source] += 1
        return self.source

    def propose(self, seq: list[int], k: int) -> Proposal:
        if k <= 0:
            return Proposal([])
        return (self.ngram if self._drafting(seq, k) == NGRAM else self.model).propose(seq, k)

    def propose_tree(self, seq: list[int], k: int) -> tuple[list[int], list[int], list[float]]:
        """With draft-model trees: the n-gram's match as a chain tree, or the model's tree."""
        if k <= 0:
            return [], [], []
        if self._drafting(seq, k) == MODEL:
            return self.model.propose_tree(seq, k)
        tokens = self.ngram.propose(seq, k).tokens
        return tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        # The source that drafted learns its outcome; the other one idles (the model) or
        # checks its match's first token for free (the n-gram).
        if self.source == NGRAM:
            self.ngram.accepted(proposed, accepted, seq)
            self.model.accepted(0, 0, seq)
        else:
            self.model.accepted(proposed if self.source == MODEL else 0,
                                accepted if self.source == MODEL else 0, seq)
            self.ngram.accepted(0, 0, seq)
        self.source = None

    def finish(self) -> None:
        self.ngram.finish()
