"""Prompt lookup: match the last n tokens of prompt+output earlier in the text and propose
what followed that earlier occurrence (Saxena's prompt lookup decoding; transformers'
`prompt_lookup_num_tokens`). Free to run, strong on summarisation, code edits and any output
that copies its input."""

from __future__ import annotations

from marscli.drafters.base import AcceptanceTracker, CostModel, DrafterBase, Proposal


class NgramDrafter(DrafterBase):
    """Proposes the continuation of the most recent earlier occurrence of the longest
    matching suffix n-gram (n from ngram_max down to ngram_min).

    An index from each n-gram to the position after its latest occurrence is kept up to date
    as the sequence grows, so a lookup costs O(ngram_max) instead of a scan of the text.
    Each n keeps its own acceptance estimate: a 3-gram match is worth more than a 1-gram one.
    """

    name = "ngram"

    def __init__(self, k_max: int, *, ngram_max: int = 3, ngram_min: int = 1,
                 cost: CostModel | None = None, adaptive: bool = True):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.k_max = k_max
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.cost = cost or CostModel()
        self.adaptive = adaptive
        self._last_n = 0
        self.start([])

    def start(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed
        self._trackers = {n: AcceptanceTracker(self.k_max, self.cost, adaptive=self.adaptive)
                          for n in range(self.ngram_min, self.ngram_max + 1)}

    def _extend_index(self, seq: list[int]) -> None:
        # Index every n-gram that ends strictly before the last token, so the suffix itself
        # never matches its own position.
        end = len(seq) - 1
        for stop in range(max(self._indexed, 1), end + 1):
            for n, table in self._index.items():
                if stop - n >= 0:
                    table[tuple(seq[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end + 1)

    def propose(self, seq: list[int], k_max: int) -> Proposal:
        self._last_n = 0
        if k_max <= 0 or len(seq) < 2:
            return Proposal([])
        self._extend_index(seq)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seq) <= n:
                continue
            pos = self._index[n].get(tuple(seq[-n:]))
            if pos is None:
                continue
            available = len(seq) - pos
            k = self._trackers[n].choose_k(min(available, k_max))
            self._last_n = n
            return Proposal(seq[pos:pos + k])
        return Proposal([])

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        if self._last_n and proposed:
            self._trackers[self._last_n].update(proposed, accepted)
        elif self._last_n:
            # A match whose policy chose k = 0: nothing was tested, so nothing is learned;
            # decay the estimate's weight slightly so it can recover.
            t = self._trackers[self._last_n]
            t.successes *= 0.98
            t.failures *= 0.98


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding through the same engine (k = 0 every step)."""

    name = "none"

    def start(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        pass

    def propose(self, seq: list[int], k_max: int) -> Proposal:
        return Proposal([])

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        pass
