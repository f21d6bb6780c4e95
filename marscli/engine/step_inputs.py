"""What a step hands the verifier beside the logits, built once for chain and tree steps alike:
the positions a relaxed rule must judge strictly (the loop guard, strict spans, the output's
strict first tokens, stop tokens), each row's remaining relaxation budget, the records' seeds
and output positions (the sampled draws), the proposals after the drafts and the regret
rule's running sum.

Every flag is a function of the row's own text and its proposals (marscli.engine.sequence),
so a position is guarded the same whichever step judges it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from marscli.engine.sequence import Sequence
from marscli.verification.chain import NO_PROPOSAL
from marscli.verification.rules import stop_positions


@dataclass
class ChainInputs:
    """A chain step's verifier inputs besides drafts and logits (device tensors, [B] or [B, W])."""

    bonus: torch.Tensor | None  # [B] long: each row's proposal after its drafts (NO_PROPOSAL: none)
    seeds: torch.Tensor | None  # [B] long (sampled rows only)
    positions: torch.Tensor | None  # [B] long: the output position of each row's first logits row
    guard: torch.Tensor | None  # [B, W] bool: judge strictly here
    relax_left: torch.Tensor | None  # [B] long
    regret: torch.Tensor | None  # [B] float64: the regret rule's running sum
    #: per row, per position: the position lies in a strict span (on the host), or None
    spans: list[list[bool]] | None


#: A row's relaxations left when nothing limits them (beside rows that have a limit).
NO_LIMIT = 1 << 30


def judged(seq: Sequence) -> bool:
    """Does the row read its guards: a relaxed rule, or an observer (calibration records them
    for its replay of relaxed rules)?"""
    return seq.settings.relaxing or seq.observer is not None


def proposals_of(drafts: list[int], nxt: int | None) -> list[int]:
    """A row's proposals by position: its drafts, then the one after them (if any)."""
    return drafts if nxt is None else drafts + [nxt]


def chain_inputs(seqs: Seq[Sequence], drafts: list[list[int]], nexts: list[int | None], K: int,
                 logits: torch.Tensor, *, relaxes: bool, regret: bool,
                 top1: torch.Tensor | None = None) -> ChainInputs:
    """The verifier inputs of a chain step: logits [B, K+1, V] (for the stop positions) and
    their argmax top1 [B, K+1] when the caller has it."""
    W = K + 1
    dev = logits.device
    props = [proposals_of(d, x) for d, x in zip(drafts, nexts)]
    bonus = None
    if any(x is not None for x in nexts):
        bonus = torch.tensor([NO_PROPOSAL if x is None else x for x in nexts], dtype=torch.long).to(dev)
    seeds = positions = None
    if any(not s.sampling.greedy for s in seqs):
        seeds = torch.tensor([s.sampling.seed for s in seqs], dtype=torch.long).to(dev)
        positions = torch.tensor([len(s.out) for s in seqs], dtype=torch.long).to(dev)
    relax_left = None
    lefts = [s.relax_left() for s in seqs] if relaxes else []
    if any(x is not None for x in lefts):  # a budget, or rewinds used up: None is no limit
        relax_left = torch.tensor([NO_LIMIT if x is None else x for x in lefts], dtype=torch.long).to(dev)
    carry = torch.tensor([s.regret for s in seqs], dtype=torch.float64).to(dev) if regret else None
    wanted = [judged(s) for s in seqs]
    if not any(wanted) or not any(props):
        return ChainInputs(bonus, seeds, positions, None, relax_left, carry, None)
    m = [[False] * W for _ in seqs]
    spans: list[list[bool]] | None = None
    for b, (s, p) in enumerate(zip(seqs, props)):
        if not p or not wanted[b]:
            continue
        flags = s.repeats(p)
        if s.spans is not None:
            span = s.strict_spans(p)
            spans = spans or [[] for _ in seqs]
            spans[b] = span
            flags = [a or c for a, c in zip(flags, span)]
        if s.strict_first > len(s.out):
            flags = [a or c for a, c in zip(flags, s.strict_first_flags(list(range(1, len(p) + 1))))]
        if s.strict_at:  # positions a loop rewind decided strictly
            flags = [a or c for a, c in zip(flags, s.rewound_flags(len(p)))]
        m[b][: len(p)] = flags
    guard = torch.tensor(m, dtype=torch.bool).to(dev)
    stops = [s.stop_tokens for s in seqs]
    if any(stops):
        S = max(len(t) for t in stops)
        table = torch.tensor([list(t) + [-1] * (S - len(t)) for t in stops], dtype=torch.long)
        tok = torch.tensor([list(p) + [0] * (W - len(p)) for p in props], dtype=torch.long)
        guard = guard | stop_positions(tok.to(dev), logits[:, :W], table.to(dev),
                                       None if top1 is None else top1[:, :W])
    return ChainInputs(bonus, seeds, positions, guard, relax_left, carry, spans)


def tree_guard(seq: Sequence, tokens: list[int], parents: list[int], logits: torch.Tensor,
               depths: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A tree step's guard per node ([N] bool: judge node i strictly; None: nothing guarded)
    and the strict-span flags alone ([N] or None): the same questions the chain's positions
    are asked, along each node's root path. logits [N+1, V] (node i is judged by its
    parent's row)."""
    if not judged(seq):
        return None, None
    guard = span = None
    if seq.ngrams is not None:
        guard = torch.tensor(tree_repeats(seq, tokens, parents), dtype=torch.bool)  # [N]
    if seq.spans is not None:
        span = torch.tensor(seq.strict_spans_tree(tokens, parents), dtype=torch.bool)  # [N]
        guard = span.clone() if guard is None else guard | span
    if seq.strict_first > len(seq.out):
        first = torch.tensor(seq.strict_first_flags(depths), dtype=torch.bool)
        guard = first if guard is None else guard | first
    if seq.stop_tokens:
        N = len(tokens)
        rows = torch.tensor(parents, dtype=torch.long, device=logits.device) + 1
        judge = logits[rows]  # [N, V] each node's parent's row (the root's: row 0)
        stop = stop_positions(torch.tensor(tokens, dtype=torch.long, device=logits.device).view(1, N),
                              judge.unsqueeze(0), torch.tensor([seq.stop_tokens], dtype=torch.long))[0]
        # on the logits' device: the verdict's one transfer brings what it decided
        guard = stop if guard is None else guard.to(stop.device) | stop
    return guard, span


def tree_repeats(seq: Sequence, tokens: list[int], parents: list[int]) -> list[bool]:
    """The loop guard's verdict for every node of a draft tree: its root path (the drafts
    ahead of it) and then the node, as a chain draft would be judged."""
    out = []
    for i in range(len(tokens)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(seq.repeats([tokens[j] for j in reversed(path)])[-1])
    return out
