"""Hybrid drafting: prompt lookup where it has a strong match, the draft model elsewhere.

An n-gram match costs nothing to draft (it copies from the prompt, the output so far, or the
job's finished records); a draft model costs a forward per drafted token but drafts
everywhere. ``HybridDrafter`` holds one of each for a record and chooses between them at
every position, from the row's text alone: the n-gram's proposal where its longest match
is at least ``min_match`` tokens long (a long match is the strongest evidence prompt lookup
has), the draft model's token elsewhere. The choice is a function of the text, so the
relaxed rules can judge the proposal at every position (marscli.verification.chain) and a
record's text never depends on its draft lengths, the batch or measured timings.

A chain mixes the sources position by position: the draft model's cache catches up on the
tokens the n-gram proposed in one forward the next time a position needs the model
(ModelDrafter.token_after). Both parts keep learning: the hybrid's acceptance estimate
prices its chains (``offer``), and the n-gram side checks its proposals for free.
"""

from __future__ import annotations

from marscli.config import SamplingParams
from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal
from marscli.drafters.kinds import MODEL, NGRAM

#: The n-gram proposes at a position when its longest suffix match is at least this long
#: (capped at the drafter's ngram_max).
HYBRID_MIN_MATCH = 3


class HybridDrafter(DrafterBase):
    """One record's drafter: an NgramDrafter and a ModelDrafter, chosen per position."""

    name = "hybrid"

    def __init__(self, ngram, model, min_match: int = HYBRID_MIN_MATCH):
        self.ngram = ngram
        self.model = model
        self.min_match = min(min_match, ngram.ngram_max)
        self.sampling = SamplingParams()
        self.tracker = AcceptanceTracker()
        #: positions proposed by each source (for tests and narration)
        self.steps = {NGRAM: 0, MODEL: 0}

    @property
    def k_max(self) -> int:
        return self.model.k_max

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.ngram.start(prompt_ids, sampling)
        self.model.start(prompt_ids, sampling)
        self.tracker = AcceptanceTracker()

    def source(self, seq: list[int], ahead: list[int]) -> tuple[str, int | None]:
        """Which part proposes the position after seq + ahead, and the n-gram's token there."""
        found = self.ngram.lookup(seq, ahead)
        if found is not None and found[0] >= self.min_match:
            pos = found[1]
            return NGRAM, seq[pos] if pos < len(seq) else ahead[pos - len(seq)]
        return MODEL, None

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return self.tracker.offer(k_max)

    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        m = max(k, 0) + bonus
        out: list[int] = []
        for _ in range(m):
            src, tok = self.source(seq, out)
            if tok is None:
                tok = self.model.token_after(seq + out)
            self.steps[src] += 1
            out.append(tok)
        k = max(k, 0)
        return Proposal(out[:k], out[k] if bonus and len(out) > k else None)

    def propose_tree(self, seq: list[int], k: int) -> tuple[list[int], list[int], list[float]]:
        """With draft-model trees: the n-gram's chain where it has a strong match at the first
        position, else the model's tree."""
        if k <= 0:
            return [], [], []
        if self.source(seq, [])[0] == MODEL:
            self.steps[MODEL] += 1
            return self.model.propose_tree(seq, k)
        tokens = self.propose(seq, k).tokens
        return tokens, list(range(-1, len(tokens) - 1)), [1.0] * len(tokens)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)
        self.ngram.accepted(0, 0, seq)

    def rewind(self, seq: list[int]) -> None:
        self.ngram.rewind(seq)  # (the draft model's cache catches up with seq by itself)

    def finish(self) -> None:
        self.ngram.finish()
