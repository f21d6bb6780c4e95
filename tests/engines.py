"""Engine-side helpers shared by test modules: prompts, test drafters and engine builders
(fixtures are in conftest.py, the oracles the engine is compared with in oracles.py)."""

from __future__ import annotations

import torch

from marscli.config import DraftConfig, VerifyConfig
from marscli.drafters.base import DrafterBase, Proposal
from marscli.engine import build_engine
from marscli.engine.scheduler import Engine
from marscli.verification.rules import top2

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "a margin aware rule",
    "speculative decoding drafts tokens and the target verifies them in one pass. speculative",
]


def encode(target, text: str) -> list[int]:
    return target.tokenizer(text).input_ids


def position_chain(seq: list[int], k: int, bonus: bool, proposal) -> Proposal:
    """k drafts and (with bonus) the proposal after them, each proposal(text) after the text
    and the drafts before it: a position-wise drafter's chain."""
    out, cur = [], list(seq)
    with torch.no_grad():
        for _ in range(max(k, 0) + bonus):
            tok = proposal(cur)
            out.append(tok)
            cur.append(tok)
    k = max(k, 0)
    return Proposal(out[:k], out[k] if bonus else None)


class RunnerUpDrafter(DrafterBase):
    """Test drafter: proposes the target's own greedy token, but its top-2 where the text's
    length is a multiple of 3, so the verifier meets a runner-up to relax every few positions;
    a function of the text (a position-wise drafter)."""

    name = "runner-up"

    def __init__(self, model, k: int):
        self.model, self.k = model, k

    def start(self, prompt_ids, *_, **__):
        pass

    def proposal(self, text: list[int]) -> int:
        _, _, t1, t2 = top2(self.model(torch.tensor([text])).logits[0, -1])
        return int(t2 if len(text) % 2 == 0 else t1)

    def propose(self, seq, k_max, bonus=False):
        return position_chain(seq, min(self.k, k_max), bonus, self.proposal)

    def accepted(self, proposed, accepted, seq):
        pass


def make_engine(target, kind: str, draft=None, *, k: int = 4, adaptive: bool = False,
                verify: VerifyConfig = VerifyConfig(), batch_size: int = 1, job_corpus: bool | None = None,
                prefix_cache_mib: float = 64, compile_mode: str = "auto", **draft_fields) -> Engine:
    """build_engine for `kind`'s drafter (draft: the loaded draft model or EAGLE-3 head) with k
    drafts a step, fixed unless adaptive; the kinds that name a model get a placeholder name.
    draft_fields: more DraftConfig fields (a tree's shape, hybrid, context). prefix_cache_mib:
    0 turns the prefix cache off. compile_mode: --compile ("static": a captured step's shapes,
    run eagerly)."""
    cfg = DraftConfig(kind=kind, num_draft_tokens=k, adaptive=adaptive,
                      model="x" if kind in ("model", "eagle3") else None, **draft_fields)
    return build_engine(target, draft, verify, cfg, batch_size=batch_size, job_corpus=job_corpus,
                        prefix_cache_mib=prefix_cache_mib, compile_mode=compile_mode)


class RankDrafter(DrafterBase):
    """Test drafter: proposes the target's own token of rank 1, 2, 3, 2, 1, ... by the text's
    length, so every rule finds tokens of every rank to judge; a function of the text."""

    name = "rank"

    def __init__(self, model, k: int):
        self.model, self.k = model, k

    def start(self, prompt_ids, *_, **__):
        pass

    def proposal(self, text: list[int]) -> int:
        z = self.model(torch.tensor([text])).logits[0, -1]
        rank = (1, 2, 3, 2)[len(text) % 4]
        return int(torch.topk(z, rank).indices[-1])

    def propose(self, seq, k_max, bonus=False):
        return position_chain(seq, min(self.k, k_max), bonus, self.proposal)

    def accepted(self, proposed, accepted, seq):
        pass
