"""A separate, smaller draft model with its own KV cache."""

from __future__ import annotations

import torch

from marscli.config import SamplingParams
from marscli.drafters.base import AcceptanceTracker, DrafterBase, DraftOffer, Proposal
from marscli.models.kvcache import HoleCache, cache_kw, new_cache, rollback
from marscli.verification.chain import sample_from, sampling_probs


def fit_vocab(logits: torch.Tensor, vocab_size: int | None) -> torch.Tensor:
    """Draft logits [V_draft] cut or -inf-padded to the target's width: padded embedding rows
    are never drafted, and tokens the draft model lacks get probability 0."""
    if vocab_size is None or logits.shape[-1] == vocab_size:
        return logits
    if logits.shape[-1] > vocab_size:
        return logits[: vocab_size]
    pad = logits.new_full((vocab_size - logits.shape[-1],), float("-inf"))
    return torch.cat([logits, pad])


def reusable_prefix(cached: list[int], seq: list[int]) -> int:
    """How many leading tokens of a draft cache still match the committed sequence; at least
    seq's last token is always fed again (its logits start the next draft)."""
    common = 0
    for a, b in zip(cached, seq):
        if a != b:
            break
        common += 1
    return min(common, len(seq) - 1)


def draft_token(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[int, torch.Tensor | None]:
    """One draft token from draft logits [V]: the argmax (greedy; q one-hot) or a draw from
    the filtered draft distribution q, returned with it."""
    if sampling.greedy:
        return int(logits.argmax()), None
    q = sampling_probs(logits.unsqueeze(0), sampling.temperature, sampling.top_k, sampling.top_p)  # [1, V]
    u = torch.rand(1, generator=generator)
    return int(sample_from(q, u)[0]), q[0]


class DraftModelSettings:
    """What every draft-model drafter holds: the model, its device, K and the target's
    vocabulary width (draft probabilities are padded or cut to it)."""

    def __init__(self, model, k_max: int, *, vocab_size: int | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.k_max = k_max
        self.vocab_size = vocab_size


class ModelDrafter(DraftModelSettings, DrafterBase):
    """Drafts k tokens autoregressively with a small model sharing the target's vocabulary.

    Its cache holds a prefix of the committed sequence plus the drafts it fed itself; after
    verification it keeps only the part the target accepted. Greedy decoding drafts argmax
    tokens (one-hot q); sampling drafts from the draft model's own filtered distribution and
    hands that distribution to the verifier.
    """

    name = "model"

    def __init__(self, model, k_max: int, **kw):
        super().__init__(model, k_max, **kw)
        self.sampling = SamplingParams()
        self.generator: torch.Generator | None = None
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache
        self.tracker = AcceptanceTracker()

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.generator = generator
        self.cache = new_cache(self.model)
        self.cached = []
        self.tracker = AcceptanceTracker()

    def _forward(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, **cache_kw(self.model, self.cache), use_cache=True, logits_to_keep=1)
        self.cached.extend(ids)
        return out.logits[0, -1]  # [V_draft]

    def offer(self, seq: list[int], k_max: int) -> DraftOffer:
        return self.tracker.offer(k_max)

    def propose(self, seq: list[int], k: int) -> Proposal:
        if k <= 0:
            return Proposal([])
        # Bring the cache up to the committed sequence (at least the last token is new).
        common = reusable_prefix(self.cached, seq)
        rollback(self.cache, common)
        del self.cached[common:]
        logits = fit_vocab(self._forward(seq[common:]), self.vocab_size)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(k):
            tok, q = draft_token(logits, self.sampling, self.generator)
            if q is not None:
                probs.append(q)
            tokens.append(tok)
            if i + 1 < k:
                logits = fit_vocab(self._forward([tok]), self.vocab_size)
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)


class _Row:
    """One row's drafting state in a BatchedModelDrafter."""

    def __init__(self, owner: BatchedModelDrafter, sampling: SamplingParams,
                 generator: torch.Generator | None):
        self.sampling = sampling
        self.generator = generator
        self.tracker = AcceptanceTracker()
        self.cached: list[int] = []  # tokens whose keys/values are valid in the row's cache


class BatchedModelDrafter(DraftModelSettings):
    """ModelDrafter for a whole batch (a BatchedDrafter): one draft-model forward per draft
    position for all rows, over a masked HoleCache of its own.

    Each row drafts what a ModelDrafter would for it alone: the same choice of k (its own
    AcceptanceTracker) for the same k, the same greedy argmax or the same draws from its own generator;
    only the float summation order of the draft model's batched pass may differ.
    """

    feature_layers: tuple[int, ...] = ()
    tree = None

    def __init__(self, model, k_max: int, **kw):
        super().__init__(model, k_max, **kw)
        tok = getattr(model.config, "pad_token_id", None)
        self.pad_id = tok if isinstance(tok, int) else 0
        self.reset()

    def reset(self) -> None:
        self.kv = HoleCache(self.model, self.device, masked=True)
        self.rows: list[_Row] = []

    def add_row(self, prompt_ids: list[int], sampling: SamplingParams,
                generator: torch.Generator | None) -> None:
        """Prefill the new row's prompt but its last token, alone, and append the row."""
        row = _Row(self, sampling, generator)
        row.cached = list(prompt_ids[:-1])
        self.kv.add_prefilled(row.cached)
        self.rows.append(row)

    def keep(self, rows: list[int]) -> None:
        self.rows = [self.rows[b] for b in rows]
        self.kv.keep_rows(rows)

    def propose_tree(self, row: int, seq: list[int], max_path: int):
        raise NotImplementedError("a draft model drafts chains")

    def observe(self, row: int, features: torch.Tensor) -> None:
        pass

    def accepted(self, row: int, proposed: int, accepted: int, seq: list[int]) -> None:
        self.rows[row].tracker.update(proposed, accepted)

    def _feed(self, feeds: list[list[int]]) -> torch.Tensor:
        """One forward: row b appends feeds[b] (possibly none) -> logits [B, S, V_draft]."""
        B = len(self.rows)
        S = max(len(f) for f in feeds)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(B, S, dtype=torch.long)
        for b, f in enumerate(feeds):
            if f:
                ids[b, : len(f)] = torch.tensor(f)
                new_mask[b, : len(f)] = 1
        npos = torch.tensor([len(h.cached) for h in self.rows], dtype=torch.long)
        pos = npos[:, None] + torch.arange(S)[None, :]
        ids, new_mask, pos = ids.to(self.device), new_mask.to(self.device), pos.to(self.device)
        logits = self.kv.forward(ids, new_mask, pos).logits  # [B, S, V_draft]
        self.kv.commit(new_mask)
        for h, f in zip(self.rows, feeds):
            h.cached.extend(f)
        return logits

    def offers(self, seqs: list[list[int]], k_caps: list[int]) -> list[DraftOffer]:
        return [h.tracker.offer(cap) for h, cap in zip(self.rows, k_caps)]

    @torch.inference_mode()
    def propose(self, seqs: list[list[int]], ks: list[int]) -> list[Proposal]:
        rows = self.rows
        assert len(seqs) == len(ks) == len(rows)
        ks = [max(k, 0) for k in ks]
        catch: list[list[int]] = []
        for b, (h, seq, k) in enumerate(zip(rows, seqs, ks)):
            if k <= 0:
                catch.append([])
                continue
            # Bring the row's cache up to its committed sequence (at least the last token is new).
            common = reusable_prefix(h.cached, seq)
            if common < len(h.cached):
                self.kv.truncate_row(b, common)
                del h.cached[common:]
            catch.append(list(seq[common:]))
        if not any(ks):
            self.kv.trim()
            return [Proposal([]) for _ in rows]
        logits = self._feed(catch)
        last = [fit_vocab(logits[b, len(c) - 1], self.vocab_size) if c else None
                for b, c in enumerate(catch)]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for i in range(max(ks)):
            feeds: list[list[int]] = [[] for _ in rows]
            for b, (h, k) in enumerate(zip(rows, ks)):
                if i >= k:
                    continue
                tok, q = draft_token(last[b], h.sampling, h.generator)
                if q is not None:
                    probs[b].append(q)
                tokens[b].append(tok)
                if i + 1 < k:
                    feeds[b] = [tok]
            if any(feeds):
                logits = self._feed(feeds)
                for b, f in enumerate(feeds):
                    if f:
                        last[b] = fit_vocab(logits[b, 0], self.vocab_size)
        self.kv.trim()
        return [Proposal(tokens[b], torch.stack(probs[b]) if probs[b] else None) if ks[b] > 0
                else Proposal([]) for b in range(len(rows))]
