"""Per-token provenance: where each completion token came from (``--provenance``; issue 14).

One character per completion token, in order:

- ``d``: an accepted draft the strict check accepted on its own;
- ``r``: a relaxed token (the drafter's proposal, emitted only because the rule relaxed the
  check there: an accepted draft, or the proposal after a step's drafts);
- ``c``: a correction (the target's token at the step's first rejected draft);
- ``b``: a bonus (the target's token after all of the step's drafts were accepted; in a tree
  step, after a path that ended at a leaf);
- ``t``: a plain target token (a step with no drafts: no drafter, or a draft length of 0).

A result carries ``{"kinds": "ddrcb...", "relaxed": [[token_index, statistic], ...],
"relaxed_share": r / tokens}``: the statistic is the rule's at that position
(``VerifyResult.statistic``: MARS's margin statistic, ratio's p(x)/p1, ...). Stop strings and
EOS cut the record exactly where they cut its tokens, so ``len(kinds) == completion_tokens``.
"""

from __future__ import annotations

import math
from typing import Any

DRAFT = "d"
RELAXED = "r"
CORRECTION = "c"
BONUS = "b"
TARGET = "t"
KINDS = (DRAFT, RELAXED, CORRECTION, BONUS, TARGET)
#: Digits kept of a relaxed token's statistic.
STAT_DIGITS = 6


def step_kinds(relaxed: list[int | bool], n: int, k: int, bonus: bool | None = None) -> str:
    """The kinds of a step's emitted tokens before stopping rules: its n accepted drafts
    (relaxed[i]: draft i was relaxed), then the next token: relaxed when relaxed[n] (the
    proposal after the drafts, kept by the relaxed rule), else a bonus (`bonus`; default:
    all k drafts accepted) or a correction; with k == 0 a target token."""
    head = "".join(RELAXED if relaxed[i] else DRAFT for i in range(n))
    if len(relaxed) > n and relaxed[n]:
        return head + RELAXED
    if k == 0:
        return head + TARGET
    if bonus is None:
        bonus = n >= k
    return head + (BONUS if bonus else CORRECTION)


class Provenance:
    """One record's provenance so far."""

    def __init__(self) -> None:
        self.kinds: list[str] = []
        self.stats: dict[int, float | None] = {}  # token index -> statistic, relaxed tokens only

    def extend(self, kinds: str, stats: list[float | None]) -> None:
        """Append a step's kinds (already cut to the tokens it really added) and, aligned with
        them, the statistic of every relaxed token (None elsewhere)."""
        base = len(self.kinds)
        for i, kind in enumerate(kinds):
            self.kinds.append(kind)
            if kind == RELAXED:
                s = stats[i] if i < len(stats) else None
                self.stats[base + i] = None if s is None or not math.isfinite(s) else round(s, STAT_DIGITS)

    def truncate(self, n: int) -> None:
        """Keep the first n tokens' (a stop string cut the completion)."""
        del self.kinds[n:]
        for i in [i for i in self.stats if i >= n]:
            del self.stats[i]

    def to_dict(self) -> dict[str, Any]:
        n = len(self.kinds)
        relaxed = sorted(self.stats.items())
        return {"kinds": "".join(self.kinds), "relaxed": [[i, s] for i, s in relaxed],
                "relaxed_share": round(len(relaxed) / n, 4) if n else 0.0}
