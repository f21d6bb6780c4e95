"""The rulebook's tree walk: one step's draft tree verified with a chain's rule.

Same rules and words as ``marscli.verification`` (the chain walk, ``rules.decide``, the random-draw
policy): a node is judged at its parent's row by the very same per-position decision, and a
tree that is one chain is verified as that chain is (tests/verification/test_tree.py, test_repetition.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from marscli.verification.chain import STRICT_RULE, sampling_probs
from marscli.verification.draws import coupled_draw, position_keys
from marscli.verification.registry import SAMPLING_MODE, Rule
from marscli.verification.rules import (
    PositionFacts,
    decide,
    draft_facts,
    in_top2,
    margin_statistic,
    per_token,
    relaxable,
    relaxed_positions,
    statistic,
    top2,
)

#: Parent index of the root's children.
ROOT = -1


# ----------------------------------------------------------------------------- the tree

@dataclass
class DraftTree:
    """A draft tree: node i holds ``tokens[i]`` and hangs under ``parents[i]`` (ROOT = the root).

    ``parents[i] < i``, so index order is a topological order (every parent before its
    children) and siblings appear in the drafter's priority order.
    """

    tokens: torch.Tensor  # [N] long: each node's draft token (target vocabulary ids)
    parents: torch.Tensor  # [N] long: parent node index, ROOT for the root's children

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long)
        assert self.tokens.dim() == 1, f"tokens must be [N], got {tuple(self.tokens.shape)}"
        assert self.parents.shape == self.tokens.shape, (
            f"parents {tuple(self.parents.shape)} must match tokens {tuple(self.tokens.shape)}"
        )
        idx = torch.arange(len(self.parents))
        bad = (self.parents >= idx) | (self.parents < ROOT)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise ValueError(
                f"node {i} has parent {int(self.parents[i])}: a parent must be ROOT ({ROOT}) or "
                "an earlier node"
            )

    def __len__(self) -> int:
        return int(self.tokens.numel())

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        """A path (the chain case): node i is the child of node i - 1."""
        n = len(tokens)
        return DraftTree(torch.tensor(tokens, dtype=torch.long).reshape(n),
                         torch.arange(n, dtype=torch.long) - 1)

    def depth(self) -> torch.Tensor:
        """[N] long: 1 for the root's children, parent's depth + 1 below."""
        out = [0] * len(self)
        for i, p in enumerate(self.parents.tolist()):
            out[i] = 1 if p == ROOT else out[p] + 1
        return torch.tensor(out, dtype=torch.long)

    def child_lists(self) -> list[list[int]]:
        """All children at once: entry 0 the root's, entry i + 1 node i's (index order).

        Indexed like the logits rows: row r scores the tokens of child_lists()[r].
        """
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def children(self, i: int) -> list[int]:
        """Children of node i (i = ROOT: of the root), in index order."""
        assert ROOT <= i < len(self), f"no node {i} in a tree of {len(self)}"
        return [j for j, p in enumerate(self.parents.tolist()) if p == i]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        has_child = set(self.parents.tolist())
        return [i for i in range(len(self)) if i not in has_child]

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes): row r sees column c when c is r or an ancestor
        of r (the root is everyone's ancestor)."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parents.tolist()):
            m[i + 1] = m[p + 1]  # parents come first, so row p + 1 is complete
            m[i + 1, i + 1] = True
        return m


# ----------------------------------------------------------------------------- the walk


@dataclass
class TreeVerifyResult:
    """Outcome of verifying one draft tree (marscli.verification.tree.DraftTree)."""

    path: list[int]  # accepted node indices, root-to-leaf
    next_token: int  # correction (a rejection ended the path) or bonus (ended at a leaf)
    relaxed: list[bool]  # per accepted node: accepted only thanks to the relaxed rule
    statistic: torch.Tensor  # [N+1] float32: margin statistic of each row (row 0 = root's)
    relaxable: torch.Tensor  # [N+1] bool: the rule relaxes the row and the row has children
    #: [N] float32: a per-token rule's statistic of each node (judged at its parent's row);
    #: None for strict and MARS, whose statistic is the row's
    node_statistic: torch.Tensor | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def emitted(self, tree: DraftTree) -> list[int]:
        """Tokens this step emits: the accepted path's tokens, then the next token."""
        return [int(tree.tokens[i]) for i in self.path] + [self.next_token]


def verify_tree(
    tree: DraftTree,
    logits: torch.Tensor,  # [N+1, V] raw target logits: row 0 root's children, row i+1 node i's
    *,
    rule: Rule = STRICT_RULE,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,  # the record's seed (sampling)
    position: int | None = None,  # the output position row 0 judges (sampling)
    guard: torch.Tensor | None = None,  # [N] bool: never relax node i (judged at its parent's row)
    relax_left: int | None = None,  # relaxations the record may still make (None: no budget)
) -> TreeVerifyResult:
    """Verify a draft tree with the chain's rule, node by node (a node is judged at its
    parent's row); greedy when temperature == 0, else sampling.

    Greedy: the accepted path is the longest root path of ok nodes (ties: fewer relaxed
    nodes, then the first in depth-first order with children in index order); the next token
    is the top-1 of the row after it.

    Sampling: walk from the root. At each row the target's token is the position's draw
    (marscli.verification.draws: from the seed and the row's output position); a child that
    is the draw is accepted (strict). Otherwise, at a row the rule relaxes, the first ok child
    that is the top-1 (else the top-2) is accepted (MARS), or the first child whose condition
    holds (a per-token rule); else the walk ends and emits the draw. A leaf's bonus is its
    row's draw. With a strict rule the path is the target's own draws: its law exactly, and
    the same tokens whatever the tree.

    ``guard`` and ``relax_left`` as in ``verify``: a guarded node is judged strictly (in
    sampling, a row with a guarded child is walked strictly, as the chain's guarded position
    is), and no path holds more than ``relax_left`` relaxed nodes.
    """
    if temperature != 0.0 and SAMPLING_MODE not in rule.modes:
        raise ValueError(f"the {rule.name} rule is defined for greedy decoding only")
    n = len(tree)
    assert logits.dim() == 2 and logits.shape[0] == n + 1, (
        f"logits must be [N+1, V] = [{n + 1}, V], got {tuple(logits.shape)}"
    )
    z1, z2, t1, t2 = top2(logits)  # each [N+1]
    stat = margin_statistic(z1, z2, rule.margin)  # [N+1]
    kids = tree.child_lists()
    parents = tree.parents.to(logits.device)
    has_children = torch.zeros(n + 1, dtype=torch.bool, device=logits.device)
    has_children[parents + 1] = True
    row_relaxable = relaxable(rule, stat) & has_children
    if guard is not None:
        guard = guard.to(logits.device)
        assert guard.shape == (n,), f"guard must be [N] = [{n}], got {tuple(guard.shape)}"
        # a row with a guarded child is not relaxed (the chain's guarded position, per row)
        row_guarded = torch.zeros(n + 1, dtype=torch.long, device=logits.device).index_add(
            0, parents + 1, guard.long()) > 0
        row_relaxable = row_relaxable & ~row_guarded
    budget = math.inf if relax_left is None else relax_left
    # the target's sampling law, once: the sampling walk and a per-token rule's facts read it
    p = None if temperature == 0.0 else sampling_probs(logits, temperature, top_k, top_p)  # [N+1, V]
    if per_token(rule):
        probs = torch.softmax(logits.float(), dim=-1) if p is None else p  # [N+1, V]
        node_facts = _per_token_facts(tree, logits, probs, rule)
        relax_node = decide(rule, node_facts).relaxable
        if guard is not None:
            relax_node = relax_node & ~guard
        # a row is relaxable when the rule would relax one of its children
        row_relaxable = torch.zeros(n + 1, dtype=torch.long, device=logits.device).index_add(
            0, parents + 1, relax_node.long()) > 0
        node_stat = statistic(rule, node_facts).float()  # [N]
        stat = torch.full((n + 1,), float("nan"), device=logits.device)
        stat[parents + 1] = node_stat  # a row's last child's, for reports
    else:
        node_facts = node_stat = None
    if temperature == 0.0:
        path, relaxed, nxt = _tree_greedy(tree, kids, logits, t1, t2, stat, rule, guard, budget,
                                          node_facts)
    else:
        assert seed is not None and position is not None, "sampling needs the record's seed and position"
        path, relaxed, nxt = _tree_sampling(tree, kids, p, t1, t2, stat, row_relaxable, rule,
                                            seed, position, budget, node_facts, guard)
    return TreeVerifyResult(path, nxt, relaxed, stat, row_relaxable, node_stat)


def _node_facts(tokens: torch.Tensor, alive: torch.Tensor, t1: torch.Tensor, t2: torch.Tensor,
                stat: torch.Tensor, margin: str, strict_ok: torch.Tensor) -> PositionFacts:
    """Facts of nodes `tokens` [M], each judged at its parent's row: alive [M] (p(token) > 0
    there), that row's top tokens t1/t2 [M] and statistic [M]; strict_ok [M] from the caller."""
    return PositionFacts({margin: stat}, in_top2(tokens, t1, t2, alive), strict_ok)


def _per_token_facts(tree: DraftTree, logits: torch.Tensor, probs: torch.Tensor,
                     rule: Rule) -> PositionFacts:
    """Facts of every node for a per-token rule (ratio, topk, typical, regret), each node
    judged at its parent's row with that row's original p; the regret summed along the root
    path. strict_ok is left for the walk to fill."""
    rows = tree.parents.to(logits.device) + 1  # [N]
    tok = tree.tokens.to(logits.device)
    f = draft_facts(logits[rows], tok, probs[rows], rule.needs)
    if "regret" in f:
        own, parents = f["regret"].tolist(), tree.parents.tolist()
        total = [0.0] * len(own)
        for i, r in enumerate(own):  # parents come before their children
            total[i] = r + (total[parents[i]] if parents[i] >= 0 else 0.0)
        f["regret"] = torch.tensor(total, dtype=torch.float64, device=logits.device)
    no = torch.zeros(len(tok), dtype=torch.bool, device=logits.device)  # the walk sets it
    return PositionFacts({}, None, no, **f)


def _tree_greedy(tree, kids, logits, t1, t2, stat, rule: Rule, guard=None, budget=math.inf,
                 node_facts: PositionFacts | None = None):
    """Longest ok path with at most ``budget`` relaxed nodes. Nodes are visited in depth-first
    order (children in index order), so the first path found of a given (length, relaxed
    count) wins its ties."""
    rows = tree.parents.to(logits.device) + 1  # [N] the row that judges each node
    tok = tree.tokens.to(logits.device)
    strict_ok = tok == t1[rows]
    if node_facts is not None:  # a per-token rule
        facts = node_facts
        facts.strict_ok = strict_ok
    else:
        alive = logits.float()[rows].gather(1, tok.unsqueeze(1)).squeeze(1) > -math.inf
        facts = _node_facts(tok, alive, t1[rows], t2[rows], stat[rows], rule.margin, strict_ok)
        facts.in_top2 = facts.in_top2 | strict_ok  # as in the chain: the top-1 always qualifies
    facts.guarded = guard
    d = decide(rule, facts)
    ok = d.ok.tolist()
    was_relaxed = relaxed_positions(d.ok, d.relaxable, strict_ok).tolist()
    best: tuple[int, int] = (0, 0)  # (length, -relaxed count) of the best path so far
    best_path: list[int] = []
    best_relaxed: list[bool] = []
    # stack entries: (node, path to its parent, relaxed flags so far); children pushed reversed
    stack = [(c, [], []) for c in reversed(kids[0])]
    while stack:
        i, path, flags = stack.pop()
        if not ok[i] or (was_relaxed[i] and sum(flags) >= budget):
            continue  # not ok (or over the budget): nothing below it is reachable
        path = path + [i]
        flags = flags + [bool(was_relaxed[i])]
        key = (len(path), -sum(flags))
        if key > best:
            best, best_path, best_relaxed = key, path, flags
        stack.extend((c, path, flags) for c in reversed(kids[i + 1]))
    last_row = best_path[-1] + 1 if best_path else 0
    return best_path, best_relaxed, int(t1[last_row])


def _tree_sampling(tree, kids, p, t1, t2, stat, row_relaxable, rule: Rule, seed: int, position: int,
                   budget=math.inf, node_facts: PositionFacts | None = None, guard=None):
    """The sampling walk over the rows' draws (verify_tree's docstring): the child that is the
    draw, else MARS's choice among the children of a row it relaxes, else the first child a
    per-token rule's condition keeps (on the row's p; not guarded, budget left)."""
    tokens = tree.tokens.tolist()
    depth = [0] + tree.depth().tolist()  # row r judges output position `position + depth[r]`
    path: list[int] = []
    relaxed: list[bool] = []
    row = 0
    while True:
        key = position_keys(torch.tensor([seed]), torch.tensor([position + depth[row]]))
        draw = int(coupled_draw(p[row].unsqueeze(0), key)[0])
        children = kids[row]
        strict = next((c for c in children if tokens[c] == draw), None)
        if strict is not None:
            path.append(strict)
            relaxed.append(False)
            row = strict + 1
            continue
        chosen = None
        if children and sum(relaxed) < budget:
            if node_facts is None and bool(row_relaxable[row]):  # MARS: the row's top two
                M = len(children)
                c_tok = torch.tensor([tokens[c] for c in children], dtype=torch.long, device=p.device)
                alive = p[row, c_tok] > 0
                no = torch.zeros(M, dtype=torch.bool, device=p.device)
                d = decide(rule, _node_facts(c_tok, alive, t1[row].expand(M), t2[row].expand(M),
                                             stat[row].expand(M), rule.margin, no))
                ok = d.ok.tolist()
                for want in (int(t1[row]), int(t2[row])):  # the target's favourite first
                    chosen = next((c for j, c in enumerate(children) if ok[j] and tokens[c] == want), None)
                    if chosen is not None:
                        break
            elif node_facts is not None:
                for c in children:
                    if guard is not None and bool(guard[c]):
                        continue
                    facts = PositionFacts({}, None, torch.zeros(1, dtype=torch.bool), **{
                        k: getattr(node_facts, k)[c].view(1) for k in rule.needs})
                    if bool(decide(rule, facts).ok[0]):
                        chosen = c
                        break
        if chosen is None:
            return path, relaxed, draw
        path.append(chosen)
        relaxed.append(True)
        row = chosen + 1
