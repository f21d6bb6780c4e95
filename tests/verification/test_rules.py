"""The relaxed rules beside MARS (issue 14): ratio, topk, typical, regret.

Every branch on hand-made logits over a 10-token vocabulary, at the drafts and at the
position after them (the bonus proposal); the regret rule's sum runs along the positions,
from the ``regret_carry`` a record brings into the step, and the step hands back the sum the
next position starts from; each rule at its strict end equals ``strict`` token for token
(greedy and sampling, chains and trees); a tree that is one chain is verified as that chain
(greedy and sampled); the sampled tree walk takes the child that is the position's draw, else
the first child whose condition holds; the engine with each rule equals a plain no-cache
reference loop on a tiny model (greedy, fixed K); the sampling law of a per-token rule (x
itself where its condition holds, else exactly p, the position's draw) is met, and a
deliberately broken variant fails the same test.
"""

from __future__ import annotations

import math

import pytest
import torch

from marscli.config import DraftConfig, SamplingParams
from marscli.drafters.base import RowDrafters
from marscli.engine.scheduler import Engine
from marscli.verification.chain import NO_PROPOSAL, sample_from, sampled_draws, sampling_probs, verify
from marscli.verification.draws import coupled_draw, position_keys
from marscli.verification.registry import (
    GREEDY_MODE,
    MARS,
    MODES,
    REGRET,
    RULES,
    STRICT,
    Rule,
)
from marscli.verification.tree import ROOT, DraftTree, verify_tree
from tests.engines import RankDrafter
from tests.oracles import position_loop

V = 10


def probs_logits(p: list[float]) -> torch.Tensor:
    """Logits whose softmax is p (0 -> -inf)."""
    t = torch.tensor(p, dtype=torch.float64)
    return torch.where(t > 0, t.clamp(min=1e-300).log(), torch.full_like(t, -math.inf)).float()


def one_step(rows: list[list[float]], drafts: list[int], rule: Rule) -> tuple[int, list[bool]]:
    """Greedy verification of one chain step whose K+1 rows are given as probabilities."""
    logits = torch.stack([probs_logits(r) for r in rows]).unsqueeze(0)  # [1, K+1, V]
    res = verify(torch.tensor([drafts]), logits, rule=rule)
    return int(res.num_accepted[0]), res.relaxed[0].tolist()


# p over 10 tokens: token 0 is the top-1 (0.4), 1 is 0.3, 2 is 0.2, 3 is 0.1, the rest 0.
P = [0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0, 0, 0]
TOP = [0.91] + [0.01] * 9  # a confident row: token 0


# --------------------------------------------------------------------------- knobs


def test_rule_names_knobs_and_modes():
    assert set(RULES) == {"strict", "mars", "ratio", "topk", "typical", "regret"}
    assert Rule("regret", budget=1.0).modes == (GREEDY_MODE,)
    assert all(Rule(n).modes == MODES for n in RULES if n != REGRET)
    assert Rule("typical", epsilon=0.09).alpha == pytest.approx(0.3)
    assert Rule("topk", top_n=3, delta=0.1).label() == "topk@3:0.1"
    assert Rule("ratio", rho=0.5).with_knob(0.25).rho == 0.25
    for bad in (dict(name="ratio", rho=0.0), dict(name="ratio", rho=1.5), dict(name="topk", top_n=0),
                dict(name="topk", delta=-0.1), dict(name="typical", epsilon=0.0),
                dict(name="typical", epsilon=0.5, alpha=0.0), dict(name="regret", budget=-1.0),
                dict(name="ratio", rho=float("nan")), dict(name="eagle")):
        with pytest.raises(ValueError):
            Rule(**bad)


@pytest.mark.parametrize("rule", [Rule("ratio", rho=1.0), Rule("topk", top_n=5, delta=0.0),
                                  Rule("topk", top_n=1, delta=0.5), Rule("regret", budget=0.0),
                                  Rule("typical", epsilon=1.0, alpha=math.inf), Rule(MARS)])
def test_strict_ends_do_not_relax(rule):
    assert not rule.relaxes


# --------------------------------------------------------------------------- branches


@pytest.mark.parametrize("rho,draft,n,relaxed", [
    (0.5, 1, 1, True),    # 0.3 >= 0.5 * 0.4
    (0.49, 2, 1, True),   # 0.2 >= 0.196 (rank 3)
    (0.6, 2, 0, False),   # 0.2 < 0.24
    (0.2, 3, 1, True),    # rank 4 at 0.1 >= 0.08
    (0.01, 5, 0, False),  # p(x) = 0 never relaxes
    (0.5, 0, 1, False),   # the top-1: accepted strictly, not relaxed
])
def test_ratio_branches(rho, draft, n, relaxed):
    got_n, flags = one_step([P, TOP], [draft], Rule("ratio", rho=rho))
    assert (got_n, flags[0]) == (n, relaxed)


@pytest.mark.parametrize("top_n,delta,draft,n", [
    (2, 0.1, 1, 1),    # rank 2, 0.3 >= 0.4 - 0.1
    (2, 0.05, 1, 0),   # 0.3 < 0.35
    (2, 0.5, 2, 0),    # rank 3 > N = 2 however large delta
    (3, 0.21, 2, 1),   # rank 3, 0.2 >= 0.19
    (4, 0.5, 5, 0),    # p(x) = 0
])
def test_topk_branches(top_n, delta, draft, n):
    assert one_step([P, TOP], [draft], Rule("topk", top_n=top_n, delta=delta))[0] == n


def test_topk_rank_counts_strictly_larger_logits_so_ties_share_a_rank():
    tie = [0.35, 0.35, 0.2, 0.1, 0, 0, 0, 0, 0, 0]  # tokens 0 and 1 tie for the top
    # token 1 is not the argmax (ties go to the lowest id) but has rank 1 and p = p1
    assert one_step([tie, TOP], [1], Rule("topk", top_n=1, delta=0.01))[0] == 0  # N = 1: strict
    assert one_step([tie, TOP], [1], Rule("topk", top_n=2, delta=0.01))[0] == 1
    assert one_step([tie, TOP], [2], Rule("topk", top_n=2, delta=0.5))[0] == 0  # rank 3


def _entropy(p):
    return -sum(x * math.log(x) for x in p if x > 0)


@pytest.mark.parametrize("epsilon,alpha,draft,n", [
    (0.25, 10.0, 1, 1),   # min(0.25, big) = 0.25 < 0.3: epsilon binds
    (0.35, 10.0, 1, 0),   # 0.3 < 0.35
    (0.9, 0.5, 2, 1),     # alpha binds: 0.5 * exp(-H) ~ 0.14 < 0.2
    (0.9, 0.5, 3, 0),     # 0.1 < 0.14
    (0.01, 1.0, 5, 0),    # p(x) = 0 is never above a positive threshold
])
def test_typical_branches(epsilon, alpha, draft, n):
    threshold = min(epsilon, alpha * math.exp(-_entropy(P)))
    p_x = P[draft]
    assert (p_x > threshold) == bool(n)  # the case is what its comment says
    assert one_step([P, TOP], [draft], Rule("typical", epsilon=epsilon, alpha=alpha))[0] == n


def test_regret_sums_over_the_step_and_stops_at_the_budget():
    z = torch.zeros(4, V)
    z[:, 0] = 3.0
    z[0, 1], z[1, 2], z[2, 3] = 2.0, 1.5, 2.5  # regrets of drafts 1, 2, 3: 1.0, 1.5, 0.5
    drafts = torch.tensor([[1, 2, 3]])
    for budget, n in ((0.9, 0), (1.0, 1), (2.4, 1), (2.5, 2), (3.0, 3)):
        res = verify(drafts, z.unsqueeze(0), rule=Rule("regret", budget=budget))
        assert int(res.num_accepted[0]) == n, budget
        assert res.relaxed[0, :n].all()
    # strictly accepted tokens cost nothing; shift invariance
    z2 = z.clone()
    z2[0, 1] = 3.0  # draft 1 is now tied for the top: rank 1, regret 0, but not the argmax
    res = verify(torch.tensor([[0, 2, 3]]), (z2 + 7.0).unsqueeze(0), rule=Rule("regret", budget=2.0))
    # W = K + 1 positions: the last has no proposal (no bonus given)
    assert int(res.num_accepted[0]) == 3 and res.relaxed[0].tolist() == [False, True, True, False]
    assert res.statistic[0, :3].tolist() == pytest.approx([0.0, 1.5, 2.0])  # the sum so far


def regret_logits() -> torch.Tensor:
    """[1, 4, V]: the top-1 is token 0 (logit 3) at every position; drafts 1, 2, 3 at positions
    0, 1, 2 cost 1.0, 1.5, 0.5; token 4 after them costs 1.0 (binary fractions: sums exact)."""
    z = torch.zeros(4, V)
    z[:, 0] = 3.0
    z[0, 1], z[1, 2], z[2, 3], z[3, 4] = 2.0, 1.5, 2.5, 2.0
    return z.unsqueeze(0)


@pytest.mark.parametrize("carry,budget,bonus,n,nxt,regret", [
    (0.5, 3.0, NO_PROPOSAL, 2, 0, 0.0),  # 1.5, 3.0, 3.5 > 3: draft 3 replaced, the sum restarts
    (0.0, 3.0, NO_PROPOSAL, 3, 0, 0.0),  # all kept; nothing proposed after them: the top-1, sum 0
    (0.0, 4.0, 4, 3, 4, 4.0),            # the bonus proposal costs 1.0: 4.0 <= 4, kept; sum 4
    (0.0, 3.5, 4, 3, 0, 0.0),            # 4.0 > 3.5: the bonus replaced by the top-1
    (1.0, 4.0, 0, 3, 0, 4.0),            # 2, 3.5, 4, then the top-1 bonus (kept, cost 0): sum 4
    (2.5, 3.0, NO_PROPOSAL, 0, 0, 0.0),  # the carry alone leaves 0.5: draft 1 (1.0) replaced
])
def test_regret_sum_starts_from_the_carry_and_the_step_returns_the_next_start(carry, budget, bonus, n, nxt, regret):
    res = verify(torch.tensor([[1, 2, 3]]), regret_logits(), rule=Rule("regret", budget=budget),
                 bonus=torch.tensor([bonus]), regret_carry=torch.tensor([carry], dtype=torch.float64))
    assert (int(res.num_accepted[0]), int(res.next_token[0])) == (n, nxt)
    assert res.regret.dtype == torch.float64 and float(res.regret[0]) == regret
    # the statistic is the sum so far, carry included, at every drafted position
    assert res.statistic[0, :3].tolist() == pytest.approx([carry + 1.0, carry + 2.5, carry + 3.0])


def test_regret_carry_is_budget_already_spent():
    """Starting from a carry c judges the step exactly as budget B - c with no carry; rows
    of a batch carry their own sums; without regret_carry (or for another rule) no sum is
    returned."""
    drafts = torch.tensor([[1, 2, 3]])
    for budget in (1.0, 2.0, 2.5, 3.0, 4.0):
        for carry in (0.0, 0.5, 1.0, 1.5):
            a = verify(drafts, regret_logits(), rule=Rule("regret", budget=budget),
                       regret_carry=torch.tensor([carry], dtype=torch.float64))
            if budget - carry > 0:
                b = verify(drafts, regret_logits(), rule=Rule("regret", budget=budget - carry))
                assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.relaxed, b.relaxed)
            else:
                assert int(a.num_accepted[0]) == 0
    carries = torch.tensor([0.0, 1.0, 2.0, 2.5], dtype=torch.float64)
    res = verify(drafts.expand(4, -1), regret_logits().expand(4, -1, -1), rule=Rule("regret", budget=3.0),
                 regret_carry=carries)
    assert res.num_accepted.tolist() == [3, 1, 1, 0]
    assert res.regret.tolist() == [0.0, 0.0, 0.0, 0.0]  # all replaced or none proposed after
    assert verify(drafts, regret_logits(), rule=Rule("regret", budget=3.0)).regret is None
    assert verify(drafts, regret_logits(), rule=Rule("ratio", rho=0.5),
                  regret_carry=torch.tensor([1.0], dtype=torch.float64)).regret is None


def test_regret_sum_runs_across_steps():
    """One step of drafts 1, 2, 3, or the same text in two steps (the first proposing 2 after
    its draft), the second starting from the sum the first returns: the same text. Without
    the carry the second step would forget the regret already spent."""
    z = regret_logits()
    zero = torch.zeros(1, dtype=torch.float64)
    for budget, n_one in ((3.0, 3), (2.9, 2)):
        rule = Rule("regret", budget=budget)
        one = verify(torch.tensor([[1, 2, 3]]), z, rule=rule, regret_carry=zero)
        assert int(one.num_accepted[0]) == n_one
        first = verify(torch.tensor([[1]]), z[:, :2], rule=rule, bonus=torch.tensor([2]), regret_carry=zero)
        assert (int(first.num_accepted[0]), int(first.next_token[0])) == (1, 2) and float(first.regret[0]) == 2.5
        second = verify(torch.tensor([[3]]), z[:, 2:], rule=rule, regret_carry=first.regret)
        assert one.emitted(torch.tensor([[1, 2, 3]]), 0) == [1, 2] + second.emitted(torch.tensor([[3]]), 0)
        forgetful = verify(torch.tensor([[3]]), z[:, 2:], rule=rule)
        assert int(forgetful.num_accepted[0]) == 1  # at budget 2.9 the one step replaced draft 3


def test_regret_refuses_sampling():
    z = torch.randn(1, 3, V)
    rule = Rule("regret", budget=1.0)
    with pytest.raises(ValueError, match="greedy"):
        verify(torch.tensor([[1, 2]]), z, rule=rule, temperature=0.5, seeds=torch.tensor([1]),
               positions=torch.tensor([0]))
    with pytest.raises(ValueError, match="greedy"):  # refused before anything else is checked
        verify(torch.tensor([[1, 2]]), z, rule=rule, temperature=0.5)
    with pytest.raises(ValueError, match="greedy"):
        verify_tree(DraftTree.chain([1, 2]), z[0], rule=rule, temperature=0.5, seed=1, position=0)


def test_guard_makes_a_per_token_rule_strict_there():
    rows = [P, P, TOP]
    logits = torch.stack([probs_logits(r) for r in rows]).unsqueeze(0)
    drafts = torch.tensor([[1, 1]])
    rule = Rule("ratio", rho=0.5)
    assert int(verify(drafts, logits, rule=rule).num_accepted[0]) == 2
    res = verify(drafts, logits, rule=rule, guard=torch.tensor([[False, True]]))
    assert int(res.num_accepted[0]) == 1 and bool(res.refused[0])
    res = verify(drafts, logits, rule=rule, relax_left=torch.tensor([1]))
    assert int(res.num_accepted[0]) == 1 and res.relaxed[0].tolist() == [True, False, False]
    # the position after the drafts: a guard [B, K+1] reaches the bonus proposal
    rows3 = torch.stack([probs_logits(r) for r in (P, P, P)]).unsqueeze(0)
    res = verify(drafts, rows3, rule=rule, bonus=torch.tensor([1]))
    assert int(res.next_token[0]) == 1 and res.relaxed[0].tolist() == [True, True, True]
    res = verify(drafts, rows3, rule=rule, bonus=torch.tensor([1]), guard=torch.tensor([[False, False, True]]))
    assert int(res.num_accepted[0]) == 2 and int(res.next_token[0]) == 0 and bool(res.refused[0])


# --------------------------------------------------------------------------- strict ends


STRICT_ENDS = [Rule("ratio", rho=1.0), Rule("topk", top_n=4, delta=0.0), Rule("regret", budget=0.0),
               Rule("typical", epsilon=1.0, alpha=math.inf)]
NEAR_STRICT = [Rule("ratio", rho=0.999999), Rule("topk", top_n=4, delta=1e-7),
               Rule("regret", budget=1e-7), Rule("typical", epsilon=1.0, alpha=1e30)]


def _sampling_strict(rule: Rule) -> bool:
    """Whether the rule must equal strict when sampling too. Not regret (greedy only,
    test_regret_refuses_sampling), and not ratio/topk just off their strict end: any rho < 1
    or delta > 0 keeps a top-1 proposal outright (p(x) = p1), which strict sampling keeps
    only where it is the position's draw, with probability p1 (the Rule docstring says so)."""
    return rule.name != REGRET and rule not in NEAR_STRICT[:2]


CHAIN_CASES = [(r, t) for r in STRICT_ENDS + NEAR_STRICT for t in (0.0, 0.8)
               if t == 0.0 or _sampling_strict(r)]


@pytest.mark.parametrize("rule,temperature", CHAIN_CASES, ids=[f"{r.label()}-T{t}" for r, t in CHAIN_CASES])
def test_strict_end_equals_strict_on_random_chains(rule, temperature):
    g = torch.Generator().manual_seed(3)
    B, K = 64, 5
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    drafts = torch.randint(0, V, (B, K), generator=g)
    drafts[: B // 2] = logits[: B // 2, :K].argmax(-1)  # half the rows mostly accept
    drafts[::3, 2] = (logits[::3, 2].argmax(-1) + 1) % V
    draft_len = torch.randint(0, K + 1, (B,), generator=g)
    # a proposal after the drafts for most rows: the top-1 or top-2 there, or anything
    at = logits[torch.arange(B), draft_len]  # [B, V]
    bonus = torch.where(torch.rand(B, generator=g) < 0.5, at.argmax(-1), torch.randint(-1, V, (B,), generator=g))
    kw = dict(temperature=temperature, draft_len=draft_len, bonus=bonus)
    if temperature:
        kw.update(seeds=torch.randint(0, 2**40, (B,), generator=g), positions=torch.randint(0, 1000, (B,), generator=g),
                  top_k=6)
    a, b = verify(drafts, logits, rule=Rule(STRICT), **kw), verify(drafts, logits, rule=rule, **kw)
    assert torch.equal(a.num_accepted, b.num_accepted) and torch.equal(a.next_token, b.next_token)
    assert torch.equal(a.strict_ok, b.strict_ok)
    assert not b.relaxed.any()
    if not rule.relaxes:  # at the strict end nothing is even relaxable
        assert not b.relaxable.any()
    assert int((a.num_accepted > 0).sum()) >= B // 4  # rows accept drafts: the comparison is not vacuous


@pytest.mark.parametrize("rule", STRICT_ENDS + NEAR_STRICT, ids=lambda r: r.label())
def test_strict_end_equals_strict_on_trees(rule):
    g = torch.Generator().manual_seed(5)
    tree = DraftTree(torch.tensor([1, 2, 3, 4, 5, 6, 7]), torch.tensor([-1, -1, 0, 0, 2, 2, 4]))
    for trial in range(40):
        logits = torch.randn(len(tree) + 1, V, generator=g) * 3
        temps = (0.0, 0.7) if _sampling_strict(rule) else (0.0,)
        for t in temps:
            kw = {} if not t else dict(temperature=t, seed=trial, position=3 * trial)
            a = verify_tree(tree, logits, rule=Rule(STRICT), **kw)
            b = verify_tree(tree, logits, rule=rule, **kw)
            assert (a.path, a.next_token) == (b.path, b.next_token), (trial, t)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_tree_that_is_a_chain_verifies_as_the_chain(temperature):
    """The same rule, the same seed and position: the tree walk and the chain walk agree
    token for token (sampled: the chain's position j and the tree's row j share a draw)."""
    g = torch.Generator().manual_seed(11)
    K = 4
    tree = DraftTree(torch.tensor([0, 0, 0, 0]), torch.tensor([-1, 0, 1, 2]))
    rules = [Rule("ratio", rho=0.3), Rule("topk", top_n=3, delta=0.3), Rule("typical", epsilon=0.2)]
    if not temperature:
        rules.append(Rule("regret", budget=2.0))
    relaxed = 0
    for rule in rules:
        for trial in range(40):
            logits = torch.randn(K + 1, V, generator=g) * 2
            toks = torch.randint(0, 3, (K,), generator=g)
            tree.tokens = toks
            kw = dict(temperature=temperature)
            if temperature:
                chain = verify(toks.unsqueeze(0), logits.unsqueeze(0), rule=rule, seeds=torch.tensor([trial]),
                               positions=torch.tensor([7 * trial]), **kw)
                res = verify_tree(tree, logits, rule=rule, seed=trial, position=7 * trial, **kw)
            else:
                chain = verify(toks.unsqueeze(0), logits.unsqueeze(0), rule=rule)
                res = verify_tree(tree, logits, rule=rule)
            assert res.num_accepted == int(chain.num_accepted[0]), (rule.label(), trial)
            assert res.next_token == int(chain.next_token[0])
            assert res.relaxed == chain.relaxed[0, : res.num_accepted].tolist()
            relaxed += sum(res.relaxed)
    assert relaxed > 0  # the rules relax on these chains: the comparison covers that branch


def test_tree_greedy_regret_sums_along_the_path_not_over_siblings():
    # row 0 (root): top-1 token 0; node 0 = token 1 (regret 1), node 1 = token 2 (regret 2)
    # row 1 (under node 0): top-1 token 0; node 2 = token 3 (regret 1.5)
    z = torch.zeros(4, V)
    z[0, 0], z[0, 1], z[0, 2] = 3.0, 2.0, 1.0
    z[1, 0], z[1, 3] = 3.0, 1.5
    tree = DraftTree(torch.tensor([1, 2, 3]), torch.tensor([-1, -1, 0]))
    assert verify_tree(tree, z, rule=Rule("regret", budget=2.4)).path == [0]
    assert verify_tree(tree, z, rule=Rule("regret", budget=2.5)).path == [0, 2]


# --------------------------------------------------------------------------- sampling law


def per_token_law(rule: Rule, logits: torch.Tensor, x: int, temperature: float) -> torch.Tensor:
    """The analytic law of the token emitted at a position whose (deterministic) proposal is
    x: x itself where the rule's condition holds (reference_condition on the sampling law),
    else the target's p (the position's draw)."""
    p = sampling_probs(logits.unsqueeze(0), temperature)[0].double()
    holds = reference_condition(rule, logits / temperature, x, 0.0)
    return torch.nn.functional.one_hot(torch.tensor(x), V).double() if holds else p


def emitted_first(rule: Rule, logits: torch.Tensor, x: int, temperature: float, n: int,
                  broken: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The first emitted token of n records (seeds 0..n-1) that verify the draft x (vectorised),
    with each record's draw there and whether x was relaxed."""
    lg = torch.stack([logits, logits]).unsqueeze(0).expand(n, 2, V).contiguous()
    seeds, positions = torch.arange(n), torch.full((n,), 4)
    res = verify(torch.full((n, 1), x), lg, rule=rule, temperature=temperature, seeds=seeds, positions=positions)
    first = torch.where(res.num_accepted > 0, torch.full((n,), x), res.next_token)
    p = sampling_probs(lg, temperature)
    draws = sampled_draws(p, seeds, positions)[:, 0]
    if broken:  # a broken correction: after a rejection a fresh draw from p, not the position's draw
        g = torch.Generator().manual_seed(17)
        redraw = sample_from(p[:, 0], torch.rand(n, generator=g))
        first = torch.where(res.num_accepted > 0, first, redraw)
    return first, draws, res.relaxed[:, 0]


def histogram(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=V).double() / tokens.numel()


LAW_CASES = [
    (Rule("ratio", rho=0.5), [2.0, 1.8, 1.0, 0.5, 0, 0, 0, 0, 0, 0], 1),    # holds: x always
    (Rule("ratio", rho=0.9), [2.0, 1.0, 0.9, 0.5, 0, 0, 0, 0, 0, 0], 2),    # fails: exactly p
    (Rule("topk", top_n=3, delta=0.2), [1.5, 1.2, 1.1, 0.1, 0, 0, 0, 0, 0, 0], 2),
    (Rule("typical", epsilon=0.1), [1.0, 0.9, 0.8, 0.7, 0.2, 0, 0, 0, 0, 0], 3),
    (Rule("typical", epsilon=0.6, alpha=0.05), [1.0, 0.9, 0.8, 0.7, 0.2, 0, 0, 0, 0, 0], 4),
]


@pytest.mark.parametrize("rule,z,x", LAW_CASES, ids=[c[0].label() + f"-x{c[2]}" for c in LAW_CASES])
def test_per_token_rule_sampling_meets_its_analytic_law_and_a_broken_one_does_not(rule, z, x):
    logits = torch.tensor(z) * 2
    law = per_token_law(rule, logits, x, temperature=0.7)
    def tv(h):
        return 0.5 * float((h - law).abs().sum())
    first, draws, relaxed = emitted_first(rule, logits, x, 0.7, 64000)
    if law.max() < 1.0:  # the condition fails: the token IS the position's draw, never relaxed
        assert torch.equal(first, draws) and not relaxed.any()
    else:  # the condition holds: x always, relaxed exactly where it is not the draw
        assert (first == x).all() and torch.equal(relaxed, draws != x)
    small = histogram(emitted_first(rule, logits, x, 0.7, 4000)[0])
    big = histogram(first)
    assert tv(big) < 0.015
    assert tv(big) <= tv(small) + 0.005  # the distance shrinks (or stays at noise) with samples
    if law.max() < 1.0:  # where the condition fails, a broken correction must show
        assert tv(histogram(emitted_first(rule, logits, x, 0.7, 64000, broken=True)[0])) > 0.03


# --------------------------------------------------------------------------- sampled trees


def row_draw(p: torch.Tensor, seed: int, position: int) -> int:
    return int(coupled_draw(p.view(1, -1), position_keys(torch.tensor([seed]), torch.tensor([position])))[0])


def test_sampled_tree_takes_the_draw_else_the_first_child_whose_condition_holds():
    """Per-token rule, sampled tree: at a row the child that is the position's draw is
    accepted (strict), whatever its place among its siblings; otherwise the first child, in
    index order, whose condition holds and that is not guarded (relaxed); otherwise the walk
    ends with the draw. A leaf's next token is its row's draw (the next position's)."""
    # ratio 0.5 on P: tokens 0 (0.4) and 1 (0.3) qualify, 3 (0.1) does not
    tree = DraftTree(torch.tensor([3, 1, 0]), torch.tensor([ROOT, ROOT, ROOT]))
    rows = [P, TOP, TOP, TOP]
    logits = torch.stack([probs_logits(r) for r in rows])
    p = sampling_probs(logits, 1.0)
    rule = Rule("ratio", rho=0.5)
    seen = set()
    for seed in range(120):
        d0 = row_draw(p[0], seed, 10)
        for guard, fallback in ((None, 1), (torch.tensor([False, True, False]), 2)):
            res = verify_tree(tree, logits, rule=rule, temperature=1.0, seed=seed, position=10, guard=guard)
            if d0 in (3, 1, 0):
                node, relaxed = [3, 1, 0].index(d0), False
            else:
                node, relaxed = fallback, True
            assert res.path == [node] and res.relaxed == [relaxed], (seed, d0)
            assert res.next_token == row_draw(p[node + 1], seed, 11)
        seen.add(d0 if d0 in (3, 1, 0) else "other")
    assert seen == {3, 1, 0, "other"}  # every branch was taken
    # no child qualifies (token 3 alone) and it is not the draw: the walk ends with the draw
    lone = DraftTree(torch.tensor([3]), torch.tensor([ROOT]))
    for seed in range(60):
        d0 = row_draw(p[0], seed, 10)
        res = verify_tree(lone, logits[:2], rule=rule, temperature=1.0, seed=seed, position=10)
        assert (res.path, res.next_token) == (([0], row_draw(p[1], seed, 11)) if d0 == 3 else ([], d0))


def test_sampled_tree_relaxation_budget_caps_the_path():
    """relax_left bounds the relaxed nodes of a sampled path: below the last allowed
    relaxation only the draws are accepted."""
    tree = DraftTree.chain([1, 1, 1])
    logits = torch.stack([probs_logits(P)] * 4)
    p = sampling_probs(logits, 1.0)
    rule = Rule("ratio", rho=0.5)
    for seed in range(40):
        for left in (0, 1, 2, 3):
            res = verify_tree(tree, logits, rule=rule, temperature=1.0, seed=seed, position=0, relax_left=left)
            assert sum(res.relaxed) <= left
            # the walk itself: keep 1 while it is the draw or a relaxation is left
            path, used = [], 0
            for depth in range(3):
                if row_draw(p[depth], seed, depth) == 1:
                    path.append(depth)
                elif used < left:
                    path.append(depth)
                    used += 1
                else:
                    break
            assert res.path == path, (seed, left)


# --------------------------------------------------------------------------- the engine


def reference_condition(rule: Rule, z: torch.Tensor, x: int, regret_so_far: float) -> bool:
    """Each rule's condition written from its formula, in plain Python floats."""
    zs = [float(v) for v in z]
    m = max(zs)
    ex = [math.exp(v - m) for v in zs]
    p = [e / sum(ex) for e in ex]
    if rule.name == "ratio":
        return p[x] >= rule.rho * max(p) and p[x] > 0
    if rule.name == "topk":
        rank = 1 + sum(1 for v in zs if v > zs[x])
        return rank <= rule.top_n and p[x] >= max(p) - rule.delta and p[x] > 0
    if rule.name == "typical":
        h = -sum(q * math.log(q) for q in p if q > 0)
        return p[x] > min(rule.epsilon, rule.alpha * math.exp(-h))
    if rule.name == "regret":
        return regret_so_far + (m - zs[x]) <= rule.budget
    raise AssertionError(rule.name)


def reference_loop(model, ids, max_new, k, rule: Rule, eos: frozenset[int]) -> tuple[list[int], int]:
    """The rule position by position (oracles.position_loop) on the RankDrafter's proposal
    for each position: kept when it is the top-1 or the rule's condition holds, else the
    top-1; the regret sums over the proposals kept since the last one replaced."""
    regret = [0.0]
    drafter = RankDrafter(model, k)

    def judge(z, d, out, relaxed):
        top = int(z.argmax())
        if d == top:
            return top, False
        if reference_condition(rule, z, d, regret[0]):
            regret[0] += float(z.max() - z[d])
            return d, True
        regret[0] = 0.0
        return top, False

    return position_loop(model, ids, max_new, drafter.proposal, judge, eos)


ENGINE_RULES = [Rule("ratio", rho=0.3), Rule("topk", top_n=3, delta=0.3),
                Rule("typical", epsilon=0.05), Rule("regret", budget=1.5)]
PROMPTS = ["the quick brown fox jumps over the lazy dog",
           "one two three four five six seven eight nine ten one two three",
           "a margin aware rule"]


@pytest.mark.parametrize("rule", ENGINE_RULES, ids=lambda r: r.label())
def test_engine_equals_the_no_cache_reference_loop(target, rule):
    k, max_new = 3, 32
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RankDrafter(target.model, k)), rule, cfg)
    eos = frozenset(int(t) for t in target.eos_token_ids)
    total = 0
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=max_new))
        ref, ref_relaxed = reference_loop(target.model, ids, max_new, k, rule, eos)
        assert res.token_ids == ref, text
        assert res.stats.relaxed == ref_relaxed
        total += ref_relaxed
    assert total > 0  # the rule had something to relax on these prompts


@pytest.mark.parametrize("rule", ENGINE_RULES, ids=lambda r: r.label())
def test_engine_batch_rows_equal_single_runs(target, rule):
    k = 3
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, adaptive=False)
    def make(bs):
        return Engine(target, RowDrafters(lambda: RankDrafter(target.model, k)), rule, cfg,
                                 batch_size=bs)
    prompts = [target.tokenizer(t).input_ids for t in PROMPTS]
    sp = SamplingParams(max_tokens=24)
    single = [make(1).generate_ids(ids, sp).token_ids for ids in prompts]
    got = dict(make(3).run(range(len(prompts)), lambda i: (prompts[i], sp)))
    assert [got[i].token_ids for i in range(len(prompts))] == single
