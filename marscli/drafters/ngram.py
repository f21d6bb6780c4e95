"""Prompt lookup: match the last n tokens of prompt+output earlier in the text and propose
what followed that earlier occurrence (Saxena's prompt lookup decoding; transformers'
`prompt_lookup_num_tokens`). Free to run, strong on summarisation, code edits and any output
that copies its input."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal
from marscli.drafters.kinds import NGRAM, NONE

#: Tokens (prompts and outputs) of the job's earlier records a JobCorpus keeps indexed; the
#: oldest records leave first. About 3 index entries a token: ~30 MB of Python dicts.
CORPUS_TOKENS = 65_536


class JobCorpus:
    """The finished records of a job (prompt and output tokens), indexed by n-gram, for the
    n-gram drafter to fall back on when a record's own text has no long match: offline jobs
    repeat themselves across records (the same instructions, answer formats, code idioms),
    the observation behind SuffixDecoding (Oliaro et al. 2024). One corpus per engine, shared
    by its rows; the engine only builds one under strict verification, where drafts cannot
    change an output (docs/engine.md, "Drafters").

    Each n-gram maps to the position after its latest occurrence in the most recent record
    that has it; records beyond ``max_tokens`` tokens in all leave oldest first."""

    def __init__(self, ngram_max: int, ngram_min: int = 1, *, max_tokens: int = CORPUS_TOKENS):
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.max_tokens = max_tokens
        self.clear()

    def clear(self) -> None:
        """Forget every record (bench calls it after its warm-up)."""
        self._docs: dict[int, tuple[int, ...]] = {}
        self._order: deque[int] = deque()
        self._next = 0
        self.tokens = 0
        self._index: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {
            n: {} for n in range(self.ngram_min, self.ngram_max + 1)}

    @property
    def records(self) -> int:
        return len(self._docs)

    def _ngrams(self, doc: tuple[int, ...]):
        # n-grams with at least one token after them
        for stop in range(1, len(doc)):
            for n, table in self._index.items():
                if stop - n >= 0:
                    yield table, doc[stop - n:stop], stop

    def add(self, tokens: Sequence[int]) -> None:
        """A finished record's prompt and output."""
        doc = tuple(tokens)
        if len(doc) < 2 or len(doc) > self.max_tokens:
            return
        did = self._next
        self._next += 1
        self._docs[did] = doc
        self._order.append(did)
        self.tokens += len(doc)
        for table, key, stop in self._ngrams(doc):
            table[key] = (did, stop)
        while self.tokens > self.max_tokens:
            self._evict(self._order.popleft())

    def _evict(self, did: int) -> None:
        doc = self._docs.pop(did)
        self.tokens -= len(doc)
        for table, key, _ in self._ngrams(doc):
            hit = table.get(key)
            if hit is not None and hit[0] == did:
                del table[key]

    def lookup(self, seq: Sequence[int], lo: int, hi: int) -> tuple[int, tuple[int, ...], int] | None:
        """(n, record, position after the n-gram) of the longest suffix of seq, n from hi
        down to lo, found in the corpus."""
        for n in range(min(hi, self.ngram_max), max(lo, self.ngram_min) - 1, -1):
            if len(seq) < n:
                continue
            hit = self._index[n].get(tuple(seq[-n:]))
            if hit is not None:
                return n, self._docs[hit[0]], hit[1]
        return None


class NgramDrafter(DrafterBase):
    """Proposes, for each position, the token that followed the most recent earlier
    occurrence of the longest matching suffix n-gram (n from ngram_max down to ngram_min) of
    the row's own text: a function of the text only, so the relaxed rules may judge it at
    every position (marscli.verification.chain). A chain of k drafts is k such lookups, each
    over the text extended by the drafts before it (``_chain``); a lookup finds nothing and
    the chain ends there.

    An index from each n-gram to the position after its latest occurrence is kept up to date
    as the sequence grows, so a lookup costs O(ngram_max) plus a scan of the drafts ahead of
    it. Each n keeps its own acceptance estimate: a 3-gram match is worth more than a 1-gram
    one.

    A lookup is free, so a row the engine lets draft nothing still learns: its proposal is
    checked against the token the step emitted (a shadow draft of one). Under strict
    verification that is exactly the chance a one-token draft would have passed.

    With a ``corpus`` (a JobCorpus shared by the job's rows; the engine gives one only under
    strict verification, where drafts cannot change a record's text), a record whose own text
    matches no suffix of ngram_max tokens looks for a longer match in the job's earlier
    records and drafts that record's continuation; every record hands its prompt and output to
    the corpus when it leaves (``finish``). Matches in the corpus keep their own acceptance
    estimates per n.
    """

    name = NGRAM

    def __init__(self, k_max: int, *, ngram_max: int = 3, ngram_min: int = 1, corpus: JobCorpus | None = None):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.k_max = k_max
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min
        self.corpus = corpus
        self.start([])

    def start(self, prompt_ids: list[int], sampling=None) -> None:
        self._index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.ngram_min, self.ngram_max + 1)}
        self._indexed = 0  # n-grams ending before this position are indexed
        ns = range(self.ngram_min, self.ngram_max + 1)
        self._trackers = {n: AcceptanceTracker() for n in ns}
        self._corpus_trackers = {n: AcceptanceTracker() for n in ns}
        # The last offer: (len(seq), tracker, the proposals after seq made so far, the lookup
        # at seq: (n, position) for a match in the record's own text, None in the corpus)
        self._match: tuple[int, AcceptanceTracker, list[int], tuple[int, int] | None] | None = None
        self._seq: list[int] | None = None  # the committed sequence, for finish()

    def _extend_index(self, seq: list[int]) -> None:
        # Index every n-gram that ends strictly before the last token, so the suffix itself
        # never matches its own position.
        end = len(seq) - 1
        for stop in range(max(self._indexed, 1), end + 1):
            for n, table in self._index.items():
                if stop - n >= 0:
                    table[tuple(seq[stop - n:stop])] = stop
        self._indexed = max(self._indexed, end + 1)

    def lookup(self, seq: list[int], ahead: list[int] = ()) -> tuple[int, int] | None:
        """(n, position after the latest earlier occurrence) of the longest suffix n-gram of
        seq + ahead, positions counted in seq + ahead; ``ahead`` (drafts not committed) is not
        in the index, so occurrences ending inside it are found by a scan, latest first."""
        text_len = len(seq) + len(ahead)
        if text_len < 2:
            return None
        self._extend_index(seq)
        text = seq[-(self.ngram_max + len(ahead) + 1):] + list(ahead) if ahead else seq
        base = text_len - len(text)  # position of text[0]
        for n in range(self.ngram_max, self.ngram_min - 1, -1):
            if text_len <= n:
                continue
            gram = tuple(text[-n:])
            # occurrences ending at stop (exclusive) in len(seq) .. text_len - 1 involve the drafts
            for stop in range(text_len - 1, len(seq) - 1, -1):
                if stop - n >= base and tuple(text[stop - n - base: stop - base]) == gram:
                    return n, stop
            pos = self._index[n].get(gram)
            if pos is not None:
                return n, pos
        return None

    def _chain(self, seq: list[int], first: tuple[int, int], m: int) -> list[int]:
        """Up to m proposals after seq, each a lookup over seq and the proposals before it
        (``first``: the lookup at seq itself, already made)."""
        out: list[int] = []
        found: tuple[int, int] | None = first
        while found is not None and len(out) < m:
            pos = found[1]
            out.append(seq[pos] if pos < len(seq) else out[pos - len(seq)])
            if len(out) < m:
                found = self.lookup(seq, out)
        return out

    def offer(self, seq: list[int], k_max: int, bonus: bool = False) -> DraftOffer:
        self._match = None
        if k_max <= 0 and not bonus:
            return DraftOffer.none()
        found = self.lookup(seq)
        if self.corpus is not None and (found is None or found[0] < self.ngram_max):
            shared = self.corpus.lookup(seq, found[0] + 1 if found else self.ngram_min, self.ngram_max)
            if shared is not None:
                n, doc, pos = shared
                chain = list(doc[pos: pos + max(k_max, 0) + 1])
                self._match = (len(seq), self._corpus_trackers[n], chain, None)
                return DraftOffer(min(len(chain), max(k_max, 0)), self._corpus_trackers[n].alpha)
        if found is None:
            return DraftOffer.none()
        # The chain is made when proposed, for the length chosen (each draft a lookup): the
        # offer estimates it by the first match's continuation in the text.
        self._match = (len(seq), self._trackers[found[0]], [seq[found[1]]], found)
        return DraftOffer(min(len(seq) - found[1], max(k_max, 0)), self._trackers[found[0]].alpha)

    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        if self._match is None or self._match[0] != len(seq):
            self.offer(seq, k, bonus)
        if self._match is None:
            return Proposal([])
        length, tracker, chain, found = self._match
        k = max(k, 0)
        if found is not None and len(chain) < k + bonus:
            chain = self._chain(seq, found, k + bonus)
            self._match = (length, tracker, chain, found)
        return Proposal(chain[:k], chain[k] if bonus and len(chain) > k else None)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self._seq = seq
        if self._match is None:
            return
        length, tracker, chain, _ = self._match
        self._match = None
        if proposed:
            tracker.update(proposed, accepted)
        elif len(seq) > length and chain:
            # Drafted nothing: the shadow check of its proposal for the position.
            tracker.update(1, int(seq[length] == chain[0]))

    def rewind(self, seq: list[int]) -> None:
        """The index holds n-grams of text that is gone: index seq again from scratch."""
        self._index = {n: {} for n in self._index}
        self._indexed = 0
        self._match = None

    def finish(self) -> None:
        """The record left the batch: its prompt and output join the job's corpus."""
        if self.corpus is not None and self._seq is not None:
            self.corpus.add(self._seq)
        self._seq = None


class NoDrafter(DrafterBase):
    """Plain autoregressive decoding through the same engine (k = 0 every step)."""

    name = NONE

    def start(self, prompt_ids: list[int], sampling=None) -> None:
        pass

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return DraftOffer.none()

    def propose(self, seq: list[int], k: int, bonus: bool = False) -> Proposal:
        return Proposal([])

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        pass
