"""Prompt lookup: match the last n tokens of prompt+output earlier in the text and propose
what followed that earlier occurrence (Saxena's prompt lookup decoding; transformers'
`prompt_lookup_num_tokens`). Free to run, strong on summarisation, code edits and any output
that copies its input."""

from __future__ import annotations

from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal


class NgramDrafter(DrafterBase):
    """Proposes the continuation of the most recent earlier occurrence of the longest
    matching suffix n-gram (n from ngram_max down to ngram_min).

    An index from each n-gram to the position after its latest occurrence is kept up to date
    as the sequence grows, so a lookup costs O(ngram_max) instead of a scan of the text.
    Each n keeps its own acceptance estimate: a 3-gram match is worth more than a 1-gram one.

    A lookup is free, so a row the engine lets draft nothing still learns: its match's first
    token is checked against the token the step emitted (a shadow draft of one). Under strict
    verification that is exactly the chance a one-token draft would have passed (greedy: it
    equals the target's argmax; sampling: it equals the target's draw, probability p(d)).
    """

    name = "ngram"

    def __init__(self, k_max: int, *, ngram_max: int = 3, ngram_min: int = 1):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.k_max = k_max
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.start([])

    def start(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed
        self._trackers = {n: AcceptanceTracker() for n in range(self.ngram_min, self.ngram_max + 1)}
        self._match: tuple[int, int, int] | None = None  # (len(seq), n, pos) of the last offer

    def _extend_index(self, seq: list[int]) -> None:
        # Index every n-gram that ends strictly before the last token, so the suffix itself
        # never matches its own position.
        end = len(seq) - 1
        for stop in range(max(self._indexed, 1), end + 1):
            for n, table in self._index.items():
                if stop - n >= 0:
                    table[tuple(seq[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end + 1)

    def _lookup(self, seq: list[int]) -> tuple[int, int] | None:
        """(n, position after the earlier occurrence) of the longest matching suffix."""
        if len(seq) < 2:
            return None
        self._extend_index(seq)
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if len(seq) <= n:
                continue
            pos = self._index[n].get(tuple(seq[-n:]))
            if pos is not None:
                return n, pos
        return None

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        self._match = None
        if k_max <= 0:
            return DraftOffer.none()
        found = self._lookup(seq)
        if found is None:
            return DraftOffer.none()
        n, pos = found
        self._match = (len(seq), n, pos)
        return DraftOffer(min(len(seq) - pos, k_max), self._trackers[n].alpha)

    def propose(self, seq: list[int], k: int) -> Proposal:
        if self._match is None or self._match[0] != len(seq):
            self.offer(seq, k)
        if k <= 0 or self._match is None:
            return Proposal([])
        _, _, pos = self._match
        return Proposal(seq[pos:pos + k])

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        if self._match is None:
            return
        length, n, pos = self._match
        self._match = None
        if proposed:
            self._trackers[n].update(proposed, accepted)
        elif len(seq) > length and pos < length:
            # Drafted nothing: the shadow check of the match's first token.
            hit = seq[length] == seq[pos]
            self._trackers[n].update(1, int(hit))


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding through the same engine (k = 0 every step)."""

    name = "none"

    def start(self, prompt_ids: list[int], sampling=None, generator=None) -> None:
        pass

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return DraftOffer.none()

    def propose(self, seq: list[int], k: int) -> Proposal:
        return Proposal([])

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        pass
