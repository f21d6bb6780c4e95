"""The rulebook's tree walk: one step's draft tree verified with a chain's rule.

Same rules and words as ``marscli.verification`` (the chain walk, ``rules.decide``, the random-draw
policy): a node is judged at its parent's row by the very same per-position decision (the loop
guard applied by the chain's ``guarded_decision``), every node once, and a short walk over those
decisions keeps the path; a tree that is one chain is verified as that chain is
(tests/verification/test_tree.py, test_repetition.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from marscli.verification.chain import STRICT_RULE, guarded_decision, sampling_probs
from marscli.verification.draws import coupled_draw, position_keys
from marscli.verification.registry import SAMPLING_MODE, Rule
from marscli.verification.rules import (
    PositionFacts,
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
        # the structure on the host, once: a drafter builds it there (lists), and the walk,
        # the masks and the depths read it there (no transfer for a tree made on a device
        # but this one)
        parents = self.parents.tolist() if isinstance(self.parents, torch.Tensor) else list(self.parents)
        tokens = self.tokens.tolist() if isinstance(self.tokens, torch.Tensor) else list(self.tokens)
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        self.parents = torch.as_tensor(self.parents, dtype=torch.long)
        assert self.tokens.dim() == 1, f"tokens must be [N], got {tuple(self.tokens.shape)}"
        assert self.parents.shape == self.tokens.shape, (
            f"parents {tuple(self.parents.shape)} must match tokens {tuple(self.tokens.shape)}"
        )
        for i, p in enumerate(parents):
            if not ROOT <= p < i:
                raise ValueError(f"node {i} has parent {p}: a parent must be ROOT ({ROOT}) or an earlier node")
        self.parent_list: list[int] = parents
        self.token_list: list[int] = tokens

    def __len__(self) -> int:
        return len(self.parent_list)

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        """A path (the chain case): node i is the child of node i - 1."""
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))

    def depth_list(self) -> list[int]:
        """Each node's depth: 1 for the root's children, parent's depth + 1 below."""
        out = [0] * len(self)
        for i, p in enumerate(self.parent_list):
            out[i] = 1 if p == ROOT else out[p] + 1
        return out

    def depth(self) -> torch.Tensor:
        """[N] long: depth_list() as a tensor."""
        return torch.tensor(self.depth_list(), dtype=torch.long)

    def child_lists(self) -> list[list[int]]:
        """All children at once: entry 0 the root's, entry i + 1 node i's (index order).

        Indexed like the logits rows: row r scores the tokens of child_lists()[r].
        """
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parent_list):
            out[p + 1].append(i)
        return out

    def children(self, i: int) -> list[int]:
        """Children of node i (i = ROOT: of the root), in index order."""
        assert ROOT <= i < len(self), f"no node {i} in a tree of {len(self)}"
        return [j for j, p in enumerate(self.parent_list) if p == i]

    def leaves(self) -> list[int]:
        """Nodes without children, in index order."""
        has_child = set(self.parent_list)
        return [i for i in range(len(self)) if i not in has_child]

    def ancestor_mask(self) -> torch.Tensor:
        """[N+1, N+1] bool over (root, nodes): row r sees column c when c is r or an ancestor
        of r (the root is everyone's ancestor)."""
        n = len(self)
        m = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        m[:, 0] = True
        for i, p in enumerate(self.parent_list):
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
    #: relaxable on the host ([N+1] bools), as the walk's one transfer brought it
    relaxable_rows: list[bool] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.path)

    def emitted(self, tree: DraftTree) -> list[int]:
        """Tokens this step emits: the accepted path's tokens, then the next token."""
        return [tree.token_list[i] for i in self.path] + [self.next_token]


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
    parent's row); greedy when temperature == 0, else sampling. As the chain walk does, it
    judges every node once (the rule's facts, ``chain.guarded_decision``), then walks those
    decisions.

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
    if guard is not None:
        guard = guard.to(logits.device)
        assert guard.shape == (n,), f"guard must be [N] = [{n}], got {tuple(guard.shape)}"
    rows = tree.parents.to(logits.device) + 1  # [N] the row that judges each node
    z1, z2, t1, t2 = top2(logits)  # each [N+1]
    stat = margin_statistic(z1, z2, rule.margin)  # [N+1]
    # the target's sampling law, once: the draws and a per-token rule's facts read it
    p = None if temperature == 0.0 else sampling_probs(logits, temperature, top_k, top_p)  # [N+1, V]
    own = t1 if p is None else _row_draws(tree, p, seed, position)  # [N+1] the target's token at each row
    facts, prefer = _node_facts(tree, logits, rule, p, own, t1, t2, stat)
    row_guarded = None if guard is None else _any_child(guard, rows, n)  # [N+1]
    # a guarded node is judged strictly; sampling walks MARS's row with a guarded child strictly
    node_guard = guard if p is None or guard is None or per_token(rule) else row_guarded[rows]
    decision, _ = guarded_decision(rule, facts, torch.ones_like(facts.strict_ok), node_guard)
    ok = decision.ok | facts.strict_ok  # [N] the target's own token always (as in the chain)
    relaxed_t = relaxed_positions(ok, decision.relaxable, facts.strict_ok)  # [N] ok only if relaxed
    report = _row_report(rule, facts, decision.relaxable, stat, rows, row_guarded)
    # the walk's inputs come to the host in ONE transfer: ok, relaxed, strict_ok, prefer [N]
    # each, then every row's own token and whether the rule relaxes it [N+1] each
    host = torch.cat([ok.long(), relaxed_t.long(), facts.strict_ok.long(), prefer.long(), own.long(),
                      report[1].long()]).tolist()
    ok_h, relaxed = [bool(x) for x in host[:n]], [bool(x) for x in host[n: 2 * n]]
    strict_h, prefer_h = host[2 * n: 3 * n], host[3 * n: 4 * n]
    own_h, relaxable_h = host[4 * n: 5 * n + 1], [bool(x) for x in host[5 * n + 1:]]
    budget = math.inf if relax_left is None else relax_left
    if p is None:
        path = _tree_greedy(tree.child_lists(), ok_h, relaxed, budget)
    else:
        path = _tree_sampling(tree.child_lists(), [bool(x) for x in strict_h], relaxed,
                              [bool(x) for x in prefer_h], budget)
    nxt = int(own_h[path[-1] + 1 if path else 0])  # the row after the path: its top-1, or its draw
    return TreeVerifyResult(path, nxt, [relaxed[i] for i in path], *report, relaxable_rows=relaxable_h)


def _row_draws(tree: DraftTree, p: torch.Tensor, seed: int | None, position: int | None) -> torch.Tensor:
    """[N+1] long: each row's draw (marscli.verification.draws) under the law p [N+1, V]; row
    r judges output position ``position + depth(r)`` (the root's row: depth 0)."""
    assert seed is not None and position is not None, "sampling needs the record's seed and position"
    depth = torch.cat([torch.zeros(1, dtype=torch.long), tree.depth()])  # [N+1]
    return coupled_draw(p, position_keys(torch.full_like(depth, seed), position + depth))


def _node_facts(
    tree: DraftTree,
    logits: torch.Tensor,  # [N+1, V]
    rule: Rule,
    p: torch.Tensor | None,  # [N+1, V] the sampling law (None: greedy)
    own: torch.Tensor,  # [N+1] long: the target's token at each row (top-1 or draw)
    t1: torch.Tensor,  # [N+1] long: each row's top-1
    t2: torch.Tensor,  # [N+1] long: each row's top-2
    stat: torch.Tensor,  # [N+1] float32: each row's margin statistic
) -> tuple[PositionFacts, torch.Tensor]:
    """Every node's facts ([N]), each node judged at its parent's row (strict_ok: it is the
    row's own token), and the sampling walk's preference among a row's relaxable children
    ([N] bool: False first, then index order). A per-token rule (ratio, topk, typical, regret): its
    facts on the row's original p (T = 1 if greedy), the regret summed along the root path, in
    index order. Else MARS's margin facts (a rule that does not relax is judged strictly on
    them), the row's top-1 before its top-2."""
    rows = tree.parents.to(logits.device) + 1  # [N]
    tok = tree.tokens.to(logits.device)  # [N]
    strict_ok = tok == own[rows]  # [N]
    if not per_token(rule):
        alive = logits[rows, tok].float() > -math.inf if p is None else p[rows, tok] > 0  # p(token) > 0
        facts = PositionFacts({rule.margin: stat[rows]}, in_top2(tok, t1[rows], t2[rows], alive), strict_ok)
        return facts, tok != t1[rows]
    probs = torch.softmax(logits.float(), dim=-1) if p is None else p  # [N+1, V]
    f = draft_facts(logits[rows], tok, probs[rows], rule.needs)
    if "regret" in f:
        own_regret, parents = f["regret"].tolist(), tree.parents.tolist()
        total = [0.0] * len(own_regret)
        for i, r in enumerate(own_regret):  # parents come before their children
            total[i] = r + (total[parents[i]] if parents[i] >= 0 else 0.0)
        f["regret"] = torch.tensor(total, dtype=torch.float64, device=logits.device)
    return PositionFacts({}, None, strict_ok, **f), torch.zeros_like(strict_ok)


def _row_report(
    rule: Rule,
    facts: PositionFacts,  # [N] each: the nodes'
    relax_node: torch.Tensor,  # [N] bool: the rule relaxes the node (the guard applied)
    stat: torch.Tensor,  # [N+1] float32: each row's margin statistic
    rows: torch.Tensor,  # [N] long: each node's row
    row_guarded: torch.Tensor | None,  # [N+1] bool: the row has a guarded child
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """What each row reports: its statistic [N+1], whether it is relaxable [N+1], and a
    per-token rule's node statistic [N] (None: the row's margin statistic is the statistic).
    A per-token rule's row shows its last child's statistic and is relaxable when the rule
    relaxes one of its children; else a row is relaxable by the margin check when it has
    children, none of them guarded."""
    n = stat.shape[0] - 1
    if per_token(rule):
        node_stat = statistic(rule, facts).float()  # [N]
        stat = torch.full((n + 1,), float("nan"), device=stat.device)
        stat[rows] = node_stat  # a row's last child's, for reports
        return stat, _any_child(relax_node, rows, n), node_stat
    row_relaxable = relaxable(rule, stat) & _any_child(torch.ones_like(relax_node), rows, n)
    return stat, row_relaxable if row_guarded is None else row_relaxable & ~row_guarded, None


def _any_child(flags: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """[N+1] bool: some node judged at the row has the flag. flags [N] bool, rows [N] long
    (each node's row)."""
    return torch.zeros(n + 1, dtype=torch.long, device=flags.device).index_add(0, rows, flags.long()) > 0


def _tree_greedy(kids: list[list[int]], ok: list[bool], relaxed: list[bool], budget: float) -> list[int]:
    """The longest root path of ok nodes with at most ``budget`` relaxed nodes. Nodes are
    visited in depth-first order (children in index order), so the first path found of a
    given (length, relaxed count) wins its ties."""
    best: tuple[int, int] = (0, 0)  # (length, -relaxed count) of the best path so far
    best_path: list[int] = []
    stack = [(c, [], 0) for c in reversed(kids[0])]  # (node, path to its parent, relaxed count)
    while stack:
        i, path, used = stack.pop()
        if not ok[i] or (relaxed[i] and used >= budget):
            continue  # not ok (or over the budget): nothing below it is reachable
        path, used = path + [i], used + relaxed[i]
        if (len(path), -used) > best:
            best, best_path = (len(path), -used), path
        stack.extend((c, path, used) for c in reversed(kids[i + 1]))
    return best_path


def _tree_sampling(kids: list[list[int]], strict_ok: list[bool], relaxed: list[bool],
                   prefer: list[bool], budget: float) -> list[int]:
    """The sampling walk (verify_tree's docstring): from the root, the child that is its row's
    draw, else (budget left) the first child the rule would relax, those ``prefer`` marks
    last (MARS: a top-2 after a top-1); the walk ends at a row with neither."""
    path: list[int] = []
    row, used = 0, 0
    while True:
        chosen = next((c for c in kids[row] if strict_ok[c]), None)
        if chosen is None and used < budget:
            chosen = min((c for c in kids[row] if relaxed[c]), key=prefer.__getitem__, default=None)
            used += chosen is not None
        if chosen is None:
            return path
        path.append(chosen)
        row = chosen + 1
