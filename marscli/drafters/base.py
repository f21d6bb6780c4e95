"""The drafter interface and the draft-length policy.

A drafter's proposal for an output position is a function of the row's text so far (prompt
and output up to that position): the relaxed rules judge it there whether the step drafted
it or not (marscli.verification.chain). A chain of k drafts is therefore k proposals, each
made from the drafts before it, and ``propose(..., bonus=True)`` adds the proposal for the
position after them (``Proposal.next``), so the rule judges that position too.

A drafter offers up to k tokens for one sequence (``offer``: how many it has and how often
its drafts pass) and learns how many of them the target accepted. The engine then chooses
every row's draft length for the step at once (``choose_draft_lengths``): the step costs
the longest row's length (rows are padded to it), measured (marscli.engine.costs.StepCosts), and
what it buys is each row's expected emitted tokens. Drafters propose exactly what they are
asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from marscli.config import SamplingParams

#: A row that has not drafted for this many steps drafts one token in the next step (a
#: probe), so its acceptance estimate keeps learning (drafters that cannot check their
#: proposals for free: a draft model, an EAGLE-3 head).
PROBE_AFTER_STEPS = 16
#: Drafting must promise at least this much more goodput than the next shorter length:
#: ties and estimation noise go to the cheaper step (a plain one at worst).
MIN_GAIN = 0.01
#: Acceptance estimates are clipped here (a geometric series needs alpha < 1).
MAX_ALPHA = 0.999


class AcceptanceTracker:
    """Running estimate of one row's per-token acceptance probability alpha.

    Accepted drafts in a step follow a geometric law: each observation is n successes and,
    when n < k, one failure. Counts decay so the estimate follows the text as it changes.
    ``idle`` counts the steps since the last observation (see PROBE_AFTER_STEPS).
    """

    def __init__(self, *, prior: float = 0.6, weight: float = 2.0, decay: float = 0.9):
        self.decay = decay
        self.successes = prior * weight
        self.failures = (1.0 - prior) * weight
        self.idle = 0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    @property
    def stale(self) -> bool:
        return self.idle >= PROBE_AFTER_STEPS

    def offer(self, k_max: int) -> DraftOffer:
        """The offer of a drafter that can always draft k_max tokens (a model, a head)."""
        if k_max <= 0:
            return DraftOffer.none()
        return DraftOffer(k_max, self.alpha, self.stale)

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            self.idle += 1
            return
        self.idle = 0
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1.0 if accepted < proposed else 0.0)


@dataclass(frozen=True)
class DraftOffer:
    """What one row's drafter can draft this step, before the engine picks its length."""

    available: int  # the most drafts it can propose now (0: none, e.g. no n-gram match)
    alpha: float = 0.0  # its estimate of the per-draft acceptance probability
    probe: bool = False  # the estimate is stale: draft at least one to learn
    #: its drafts cost nothing to make (a hybrid drafter's prompt-lookup steps): the step
    #: pays no drafting for this row (choose_draft_lengths' draft_seconds)
    free: bool = False

    @staticmethod
    def none() -> DraftOffer:
        return DraftOffer(0)


def expected_tokens(alpha: float, k: int) -> float:
    """Expected tokens a chain of k drafts emits (accepted drafts + the correction or bonus)
    when each passes with probability alpha: 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)."""
    a = min(max(alpha, 0.0), MAX_ALPHA)
    return (1.0 - a ** (k + 1)) / (1.0 - a) if k > 0 else 1.0


def choose_draft_lengths(offers: Sequence[DraftOffer], step_seconds: Callable[[int], float],
                         adaptive: bool = True, critical: Sequence[bool] | None = None,
                         draft_seconds: Callable[[int], float] | None = None) -> list[int]:
    """Every row's draft length k_b for one step, maximising the batch's expected goodput.

    step_seconds(L): the step's seconds when its longest row drafts L tokens (the target
    forward over L + 1 tokens a row, every row padded to it, plus drafting L positions).
    For each common cap L the rows draft min(L, available_b): slots up to L are paid for
    by the padding anyway. The goodput of L is sum_b expected_tokens(alpha_b, k_b) /
    step_seconds(L); the best L wins, and a longer L must beat a shorter one by MIN_GAIN.
    L = 0 (every row decodes plainly) is always a candidate. Rows with a stale estimate
    (``probe``) that have something to draft make L at least 1.

    critical (the job's queue is drained: no record waits for a free row): what the step
    buys is no longer tokens but progress towards the end of the job, which is the end of
    its last row. critical[b] marks the rows that may be last (the most tokens left to
    generate); the value of L is then the least expected progress among them,
    min_b expected_tokens(alpha_b, k_b), per step second. Tokens of the other rows finish
    rows that would be done before the last one anyway; a critical row with nothing to draft
    makes every L worth one token, so the batch decodes plainly (no probes either: there is
    little left to learn for).

    draft_seconds(L): the drafting part of step_seconds(L). Given, rows whose offer is
    ``free`` pay none of it: a step at cap L costs step_seconds(L) - draft_seconds(L) +
    draft_seconds(L'), L' the longest draft among the other rows.

    adaptive=False: every row drafts all it has (a fixed K).
    """
    if not adaptive:
        return [max(o.available, 0) for o in offers]
    counted = list(offers)
    if critical is not None:
        counted = [o for o, c in zip(offers, critical) if c] or counted
    longest = max((o.available for o in counted), default=0)
    if longest <= 0:
        return [0 for _ in offers]

    def value(L: int) -> float:
        tokens = [expected_tokens(o.alpha, min(L, o.available)) for o in counted]
        return min(tokens) if critical is not None else sum(tokens)

    def seconds(L: int) -> float:
        if draft_seconds is None or not any(o.free for o in offers):
            return step_seconds(L)
        paid = max((min(L, o.available) for o in offers if not o.free), default=0)
        return step_seconds(L) - draft_seconds(L) + draft_seconds(paid)

    best_L, best = 0, value(0) / seconds(0)
    for L in range(1, longest + 1):
        rate = value(L) / seconds(L)
        if rate > best * (1.0 + MIN_GAIN):
            best_L, best = L, rate
    if best_L == 0 and critical is None and any(o.probe and o.available > 0 for o in offers):
        best_L = 1
    return [min(best_L, max(o.available, 0)) for o in offers]


@dataclass
class Proposal:
    """What a drafter proposes for one sequence: k drafts, and (when asked) its proposal for
    the position after them."""

    tokens: list[int]
    #: the proposal for the position after the drafts (propose(..., bonus=True)); None: none
    #: asked, or the drafter has none there (the target's own token is emitted)
    next: int | None = None


class Drafter(Protocol):
    """One record's drafter (ngram, none, a draft model, an EAGLE-3 head). DrafterBase gives
    the optional parts their defaults, so every drafter has every attribute the engine uses."""

    name: str
    #: Target layers whose input hidden states observe() needs; () when it reads none.
    feature_layers: tuple[int, ...]

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> None:
        """Begin a new sequence with its decoding settings (a sampling drafter draws with the
        record's seed: marscli.verification.draws)."""

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        """How many drafts (at most k_max) it could propose after `seq`, and how good."""

    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        """Propose k tokens continuing `seq` (prompt + committed output), fewer only when it
        has fewer (right after offer() for the same seq); with ``bonus`` also the proposal
        after them (``Proposal.next``)."""

    def observe(self, features: torch.Tensor) -> None:
        """Target features [S, F] of the next S committed positions, in order."""

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        """Learn the outcome of the last proposal; `seq` is the committed sequence now."""

    def rewind(self, seq: list[int]) -> None:
        """The committed sequence was taken back to `seq` (a loop rewind): forget what
        followed it."""


class TreeDrafter(Drafter, Protocol):
    def propose_tree(self, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        """A draft tree after seq: (tokens [N], parents [N], scores [N]), parents first."""


class DrafterBase:
    """Defaults for a drafter that reads no target features."""

    name = "base"
    feature_layers: tuple[int, ...] = ()

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        """A drafter that keeps no acceptance estimate offers all it may, as if always right
        (so the policy drafts it in full: a fixed K)."""
        return DraftOffer(max(k_max, 0), MAX_ALPHA) if k_max > 0 else DraftOffer.none()

    def observe(self, features: torch.Tensor) -> None:
        pass

    def rewind(self, seq: list[int]) -> None:
        """Nothing to forget: a drafter that keeps no state past the committed sequence, or
        that compares its own with it before every proposal (a draft model's cache)."""


class BatchedDrafter(Protocol):
    """What the engine drafts with: one drafter for all rows of its batch, rows added, kept
    and dropped with the engine's (same order). ``RowDrafters`` runs one Drafter per row; a
    draft model or an EAGLE-3 head drafts for every row in one pass per draft position."""

    #: Target layers whose features observe() needs (every target pass captures them).
    feature_layers: tuple[int, ...]
    #: The draft tree's shape when the engine drafts trees (batch size 1), else None.
    tree: Any

    def reset(self) -> None:
        """Drop every row."""

    def use_plan(self, plan: Any) -> None:
        """Run whatever forwards the drafter runs as the engine's StepPlan says
        (marscli.models.slots): static shapes, CUDA graphs, or eagerly."""

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        """Append a row for a new record (prefilling whatever the drafter caches)."""

    def add_rows(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> None:
        """Append a row for each new record, in order (records that join together: a drafter
        that prefills a model prefills them together)."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        """Every row's offer: at most k_caps[b] drafts after seqs[b] (none when <= 0)."""

    def propose(self, seqs: list[list[int]], ks: list[int], bonus: bool = False) -> list[Proposal]:
        """Every row's proposal: ks[b] tokens after seqs[b] (none when <= 0), right after
        offers() for the same seqs; with ``bonus`` every row's proposal after them too (a row
        with ks[b] == 0 included: its proposal for the next position)."""

    def propose_tree(self, row: int, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        """Row `row`'s draft tree (only when ``tree`` is set)."""

    def observe(self, row: int, features: torch.Tensor) -> None:
        """Target features [S, F] of row `row`'s next S committed positions."""

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        """Row `row` kept `accepted` of `proposed` drafts; seq is its committed sequence."""

    def rewind(self, row: int, seq: list[int]) -> None:
        """Row `row`'s committed sequence was taken back to `seq` (a loop rewind)."""


class RowDrafters:
    """A BatchedDrafter of one independent Drafter per row, made by `factory` (ngram, none,
    a draft model with sliding-window layers, any drafter at batch size 1)."""

    def __init__(self, factory: Callable[[], Drafter], *, feature_layers: tuple[int, ...] = (),
                 tree: Any = None, corpus: Any = None):
        self.factory = factory
        self.feature_layers = tuple(feature_layers)
        self.tree = tree
        #: The job's corpus (marscli.drafters.ngram.JobCorpus) the rows' drafters share, if any:
        #: a row's drafter hands it its record when the row leaves (``finish``).
        self.corpus = corpus
        self.rows: list[Drafter] = []

    def _finish(self, rows: list[Drafter]) -> None:
        for d in rows:
            finish = getattr(d, "finish", None)
            if finish is not None:
                finish()

    def use_plan(self, plan) -> None:
        """Per-row drafters run no batched forward: nothing follows the plan."""

    def reset(self) -> None:
        self._finish(self.rows)
        self.rows = []

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        d = self.factory()
        d.start(list(prompt_ids), sampling)
        self.rows.append(d)

    def add_rows(self, prompts: list[list[int]], samplings: list[SamplingParams]) -> None:
        for p, s in zip(prompts, samplings):
            self.add_row(p, s)

    def keep(self, rows: list[int]) -> None:
        kept = set(rows)
        self._finish([d for b, d in enumerate(self.rows) if b not in kept])
        self.rows = [self.rows[b] for b in rows]

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        return [d.offer(seq, cap) for d, seq, cap in zip(self.rows, seqs, k_caps)]

    def propose(self, seqs: list[list[int]], ks: list[int], bonus: bool = False) -> list[Proposal]:
        return [d.propose(seq, max(k, 0), bonus) if k > 0 or bonus else Proposal([])
                for d, seq, k in zip(self.rows, seqs, ks)]

    def propose_rows(self, first: int, seqs: list[list[int]]) -> list[Proposal]:
        """Rows first .. first+len(seqs)-1's proposals for the position after seqs, nothing
        drafted (a joining row's first output position, judged on the prefill's logits)."""
        return [d.propose(seq, 0, True) for d, seq in zip(self.rows[first:], seqs)]

    def propose_tree(self, row: int, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        assert self.tree is not None, "this engine drafts chains"
        drafter: TreeDrafter = self.rows[row]  # type: ignore[assignment]
        return drafter.propose_tree(seq, max_path)

    def observe(self, row: int, features: torch.Tensor) -> None:
        self.rows[row].observe(features)

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].accepted(proposed, accepted, seq)

    def rewind(self, row: int, seq: list[int]) -> None:
        self.rows[row].rewind(seq)
