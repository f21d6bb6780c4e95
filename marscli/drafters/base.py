"""The drafter interface and the adaptive draft-length policy.

A drafter proposes up to k tokens for one sequence and learns how many of them the target
accepted. Verifying k drafts is not free (see CostModel), so each drafter chooses k by expected tokens per unit of cost, from an
estimate of how often its drafts pass. The cost model is a fixed function of the input
length, never a timing, so the same input always gives the same drafts and the same output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from marscli.config import SamplingParams


@dataclass(frozen=True)
class CostModel:
    """Relative cost of one target forward pass over n new tokens (n = 1 costs 1).

    c(n) = table[n - 1] while the table lasts, then grows by per_token a token. The CPU
    table was measured with the embedded model (SmolLM2-135M, float32, 600-token context,
    2-core AVX2 CPU) with marscli.fastpath installed: 57, 52, 58, 72, 66, 68, 76, 72 ms for
    1..8 tokens. Decode is memory-bound, so verifying a few drafts costs about one token.
    """

    table: tuple[float, ...] = (1.0, 0.95, 1.02, 1.26, 1.16, 1.19, 1.3, 1.3)
    per_token: float = 0.04
    draft_step: float = 0.0  # cost of one drafter step relative to a target forward

    def target(self, n: int) -> float:
        n = max(n, 1)
        if n <= len(self.table):
            return self.table[n - 1]
        return self.table[-1] + self.per_token * (n - len(self.table))

    @staticmethod
    def for_device(device_type: str, draft_step: float = 0.0) -> CostModel:
        if device_type == "cuda":  # memory-bound decode: extra tokens are nearly free
            return CostModel(table=(1.0,), per_token=0.02, draft_step=draft_step)
        return CostModel(draft_step=draft_step)


class AcceptanceTracker:
    """Running estimate of the per-token acceptance probability alpha, and the k it implies.

    Accepted drafts in a step follow a geometric law: each observation is n successes and,
    when n < k, one failure. Counts decay so the estimate follows the text as it changes.
    """

    def __init__(self, k_max: int, cost: CostModel, *, prior: float = 0.6, weight: float = 2.0,
                 decay: float = 0.9, adaptive: bool = True):
        self.k_max = k_max
        self.cost = cost
        self.adaptive = adaptive
        self.decay = decay
        self.successes = prior * weight
        self.failures = (1.0 - prior) * weight

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def choose_k(self, available: int | None = None) -> int:
        """The k in [0, k_max] (and <= available) maximising expected tokens per cost."""
        k_cap = self.k_max if available is None else min(self.k_max, available)
        if not self.adaptive or k_cap <= 0:
            return max(k_cap, 0)
        a = min(self.alpha, 0.999)
        best_k, best = 0, 1.0 / self.cost.target(1)
        expected = 1.0
        for k in range(1, k_cap + 1):
            expected += a**k
            rate = expected / (self.cost.target(k + 1) + k * self.cost.draft_step)
            if rate > best * 1.0001:
                best_k, best = k, rate
        return best_k

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        self.successes = self.decay * self.successes + accepted
        self.failures = self.decay * self.failures + (1.0 if accepted < proposed else 0.0)


@dataclass
class Proposal:
    """What a drafter proposes for one sequence."""

    tokens: list[int]
    probs: torch.Tensor | None = None  # [k, V] draft distribution; None: deterministic (one-hot)


class Drafter(Protocol):
    """One record's drafter (ngram, none, a draft model, an EAGLE-3 head). DrafterBase gives
    the optional parts their defaults, so every drafter has every attribute the engine uses."""

    name: str
    #: Target layers whose input hidden states observe() needs; () when it reads none.
    feature_layers: tuple[int, ...]

    def start(self, prompt_ids: list[int], sampling: SamplingParams,
              generator: torch.Generator | None) -> None:
        """Begin a new sequence: its decoding settings and the drafter's own random stream."""

    def propose(self, seq: list[int], k_max: int) -> Proposal:
        """Propose up to k_max tokens continuing `seq` (prompt + committed output)."""

    def observe(self, features: torch.Tensor) -> None:
        """Target features [S, F] of the next S committed positions, in order."""

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        """Learn the outcome of the last proposal; `seq` is the committed sequence now."""


class TreeDrafter(Drafter, Protocol):
    def propose_tree(self, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        """A draft tree after seq: (tokens [N], parents [N], scores [N]), parents first."""


class DrafterBase:
    """Defaults for a drafter that reads no target features."""

    name = "base"
    feature_layers: tuple[int, ...] = ()

    def observe(self, features: torch.Tensor) -> None:
        pass


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

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams,
                generator: torch.Generator | None) -> None:
        """Append a row for a new record (prefilling whatever the drafter caches)."""

    def keep(self, rows: list[int]) -> None:
        """Keep only these rows, in this order."""

    def propose(self, seqs: list[list[int]], k_caps: list[int]) -> list[Proposal]:
        """Every row's proposal: at most k_caps[b] tokens after seqs[b] (none when <= 0)."""

    def propose_tree(self, row: int, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        """Row `row`'s draft tree (only when ``tree`` is set)."""

    def observe(self, row: int, features: torch.Tensor) -> None:
        """Target features [S, F] of row `row`'s next S committed positions."""

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        """Row `row` kept `accepted` of `proposed` drafts; seq is its committed sequence."""


class RowDrafters:
    """A BatchedDrafter of one independent Drafter per row, made by `factory` (ngram, none,
    a draft model with sliding-window layers, any drafter at batch size 1)."""

    def __init__(self, factory: Callable[[], Drafter], *, feature_layers: tuple[int, ...] = (),
                 tree: Any = None):
        self.factory = factory
        self.feature_layers = tuple(feature_layers)
        self.tree = tree
        self.rows: list[Drafter] = []

    def reset(self) -> None:
        self.rows = []

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams,
                generator: torch.Generator | None) -> None:
        d = self.factory()
        d.start(list(prompt_ids), sampling, generator)
        self.rows.append(d)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]

    def propose(self, seqs: list[list[int]], k_caps: list[int]) -> list[Proposal]:
        return [d.propose(seq, cap) if cap > 0 else Proposal([])
                for d, seq, cap in zip(self.rows, seqs, k_caps)]

    def propose_tree(self, row: int, seq: list[int], max_path: int) -> tuple[list[int], list[int], list[float]]:
        assert self.tree is not None, "this engine drafts chains"
        drafter: TreeDrafter = self.rows[row]  # type: ignore[assignment]
        return drafter.propose_tree(seq, max_path)

    def observe(self, row: int, features: torch.Tensor) -> None:
        self.rows[row].observe(features)

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].accepted(proposed, accepted, seq)
