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


class RunnerUpDrafter(DrafterBase):
    """Test drafter: proposes the target's own greedy path but puts the target's top-2 token
    first, so every step offers the verifier a runner-up to relax."""

    name = "runner-up"

    def __init__(self, model, k: int):
        self.model, self.k = model, k

    def start(self, prompt_ids, *_, **__):
        pass

    def propose(self, seq, k_max):
        k = min(self.k, k_max)
        out, cur = [], list(seq)
        with torch.no_grad():
            for i in range(k):
                logits = self.model(torch.tensor([cur])).logits[0, -1]
                _, _, t1, t2 = top2(logits)
                tok = int(t2 if i == 0 else t1)
                out.append(tok)
                cur.append(tok)
        return Proposal(out)

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
    """Test drafter: proposes the target's own tokens at ranks 1, 2, 3, 2, 1, ... along the
    target's greedy path from the drafts so far, so every rule finds tokens of every rank to
    judge."""

    name = "rank"

    def __init__(self, model, k: int):
        self.model, self.k, self.calls = model, k, 0

    def start(self, prompt_ids, *_, **__):
        self.calls = 0

    def propose(self, seq, k_max):
        out, cur = [], list(seq)
        with torch.no_grad():
            for i in range(min(self.k, k_max)):
                z = self.model(torch.tensor([cur])).logits[0, -1]
                rank = (1, 2, 3, 2)[(self.calls + i) % 4]
                tok = int(torch.topk(z, rank).indices[-1])
                out.append(tok)
                cur.append(tok)
        self.calls += 1
        return Proposal(out)

    def accepted(self, proposed, accepted, seq):
        pass
