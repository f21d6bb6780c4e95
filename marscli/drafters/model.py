"""A separate, smaller draft model with its own KV cache."""

from __future__ import annotations

import torch

from marscli.config import SamplingParams
from marscli.drafters.base import AcceptanceTracker, CostModel, Proposal
from marscli.kvcache import new_cache, rollback
from marscli.verify import sampling_probs, sample_from


class ModelDrafter:
    """Drafts k tokens autoregressively with a small model sharing the target's vocabulary.

    Its cache holds a prefix of the committed sequence plus the drafts it fed itself; after
    verification it keeps only the part the target accepted. Greedy decoding drafts argmax
    tokens (one-hot q); sampling drafts from the draft model's own filtered distribution and
    hands that distribution to the verifier.
    """

    name = "model"

    def __init__(self, model, k_max: int, *, cost: CostModel | None = None, adaptive: bool = True,
                 vocab_size: int | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.k_max = k_max
        self.cost = cost or CostModel()
        self.adaptive = adaptive
        self.vocab_size = vocab_size  # target's logits width: draft probs are padded/cut to it
        self.sampling = SamplingParams()
        self.generator: torch.Generator | None = None
        self.cache = None
        self.cached: list[int] = []  # tokens whose keys/values are in self.cache
        self.tracker = AcceptanceTracker(k_max, self.cost, adaptive=adaptive)

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.generator = generator
        self.cache = new_cache(self.model)
        self.cached = []
        self.tracker = AcceptanceTracker(self.k_max, self.cost, adaptive=self.adaptive)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.cached.extend(ids)
        return out.logits[0, -1]  # [V_draft]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:  # padded embedding rows never get drafted
            return logits[: self.vocab_size]
        pad = logits.new_full((self.vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    def propose(self, seq: list[int], k_max: int) -> Proposal:
        k = self.tracker.choose_k(k_max)
        if k <= 0:
            return Proposal([])
        # Bring the cache up to the committed sequence (at least the last token is new).
        common = 0
        for a, b in zip(self.cached, seq):
            if a != b:
                break
            common += 1
        common = min(common, len(seq) - 1)
        rollback(self.cache, common)
        del self.cached[common:]
        logits = self._fit_vocab(self._forward(seq[common:]))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        greedy = self.sampling.greedy
        for i in range(k):
            if greedy:
                tok = int(logits.argmax())
            else:
                q = sampling_probs(logits.unsqueeze(0), self.sampling.temperature,
                                   self.sampling.top_k, self.sampling.top_p)  # [1, V]
                u = torch.rand(1, generator=self.generator)
                tok = int(sample_from(q, u)[0])
                probs.append(q[0])
            tokens.append(tok)
            if i + 1 < k:
                logits = self._fit_vocab(self._forward([tok]))
        return Proposal(tokens, torch.stack(probs) if probs else None)

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)
