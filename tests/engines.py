"""Engine-side helpers shared by test modules: prompts, test drafters and engine builders
(fixtures are in conftest.py, the oracles the engine is compared with in oracles.py)."""

from __future__ import annotations

import torch

from marscli.drafters.base import DrafterBase, Proposal
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
