"""Test-only conveniences over the product's values: the walks' older keyword interfaces
(marscli.verification), and small questions only the tests ask of a tree, a span tracker,
a rule family or a record error. Kept here so the product keeps one way of saying each
thing."""

from __future__ import annotations

import math
from typing import Any

import torch

from marscli.calibration.policies import RuleFamily
from marscli.config import RecordError
from marscli.verification.chain import VerifyResult, verify
from marscli.verification.registry import LOGIT_RATIO, MARS, STRICT, Rule
from marscli.verification.spans import SpanTracker
from marscli.verification.tree import ROOT, DraftTree


def rule_from_theta(theta: float, margin: str = LOGIT_RATIO) -> Rule:
    """MARS at theta, or strict for theta = +inf (the older keyword interface)."""
    return Rule(STRICT if theta == math.inf else MARS, theta, margin)


def strict_greedy(drafts: torch.Tensor, logits: torch.Tensor,
                  draft_len: torch.Tensor | None = None) -> VerifyResult:
    """Accept drafts while they equal the target's argmax; then emit the argmax."""
    return verify(drafts, logits, rule=Rule(STRICT), draft_len=draft_len)


def mars_greedy(drafts: torch.Tensor, logits: torch.Tensor, theta: float, margin: str = LOGIT_RATIO,
                draft_len: torch.Tensor | None = None) -> VerifyResult:
    """MARS greedy verification (paper, Algorithm 1): accept the top-1; else the top-2 at a
    relaxable position; else emit the top-1 and stop."""
    return verify(drafts, logits, rule=Rule(MARS, theta, margin), draft_len=draft_len)


def speculative_sampling(drafts: torch.Tensor, logits: torch.Tensor, u_accept: torch.Tensor,
                         u_sample: torch.Tensor, *, temperature: float, top_k: int = 0,
                         top_p: float = 1.0, draft_probs: torch.Tensor | None = None,
                         theta: float = math.inf, margin: str = LOGIT_RATIO,
                         draft_len: torch.Tensor | None = None) -> VerifyResult:
    """Speculative sampling; strict for theta = +inf, MARS sampling otherwise."""
    return verify(drafts, logits, rule=rule_from_theta(theta, margin), temperature=temperature,
                  top_k=top_k, top_p=top_p, u_accept=u_accept, u_sample=u_sample,
                  draft_probs=draft_probs, draft_len=draft_len)


def path_to(tree: DraftTree, i: int) -> list[int]:
    """Node indices from the root's child down to node i (i included)."""
    assert 0 <= i < len(tree), f"no node {i} in a tree of {len(tree)}"
    parents = tree.parents.tolist()
    path = []
    while i != ROOT:
        path.append(i)
        i = parents[i]
    return path[::-1]


def strict_now(tracker: SpanTracker) -> bool:
    """Is the next position (after the tracker's committed text) strict?"""
    return tracker.rule.strict(tracker.cur.state, tracker.cur.text)


def toward_strict(family: RuleFamily, a: float, b: float) -> bool:
    """Is knob value ``a`` at or beyond ``b`` towards the family's strict end?"""
    return a <= b if family.direction > 0 else a >= b


def as_error(item: RecordError) -> dict[str, Any]:
    """A record error as a result line's error object."""
    return {"type": item.type, "message": item.message, "line": item.line}


def slot_tree_forward(model, past: list[int], tree: DraftTree, root_token: int, **kw):
    """The engine's tree step on its own: a one-row slot cache holding `past`, then one
    forward over root + every node (marscli.engine.tree_forward.tree_block's inputs as
    SlotCache.forward's block). Returns (float32 logits [N+1, V], the model's output, the
    cache); kw go to the model (output_hidden_states...)."""
    from marscli.engine.tree_forward import tree_block
    from marscli.models.slots import SlotCache

    kv = SlotCache(model, "cpu", slots=1)
    kv.add_prefilled(list(past))
    ids, pos, block = tree_block(tree, root_token, len(past), "cpu")
    out = kv.forward(ids, None, pos, block=block, **kw)
    return out.logits[0].float(), out, kv
