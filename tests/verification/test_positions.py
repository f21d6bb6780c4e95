"""Position-wise rules (marscli.verification.chain): a record's token at every output position
is the rule's verdict on the drafter's proposal for that position, so speculation with any
schedule of draft lengths computes the same text.

The oracle is a plain loop over positions, written here from the rules' formulas (not from
the verifier): at each position a toy "target" (logits that are a fixed random function of
the prefix) and a toy drafter (a proposal that is a fixed function of the prefix, or none)
give the emitted token. The speculative loop drafts chains of random lengths (each draft
the proposal after the ones before it, and the proposal after the chain), verifies them with
``verify`` and must emit the oracle's text, greedy and sampled, for MARS, ratio, topk and the
regret rule (whose sum runs across steps), with a relaxation budget, and for strict sampling
whatever the drafter. Hand-made logits then pin each branch of the position after the drafts.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from marscli.verification.chain import NO_PROPOSAL, sampled_draws, sampling_probs, verify
from marscli.verification.draws import coupled_draw, position_keys
from marscli.verification.registry import MARS, RATIO, REGRET, STRICT, TOPK, Rule
from marscli.verification.rules import margin_statistic, top2

V = 12


def world(prefix: tuple[int, ...]) -> torch.Tensor:
    """The toy target: logits [V], a fixed random function of the prefix (with close calls)."""
    g = torch.Generator().manual_seed(hash(prefix) % (2**31))
    z = torch.randn(V, generator=g) * 2.0
    if torch.rand(1, generator=g) < 0.4:  # a close call between the top two
        i, j = torch.randint(0, V, (2,), generator=g).tolist()
        z[j] = z.max() + 0.3
        z[i] = z[j] - 0.05
    return z


def proposer(prefix: tuple[int, ...]) -> int | None:
    """The toy drafter: the target's top-2 often, its top-1 sometimes, a random token or
    nothing otherwise; a fixed function of the prefix."""
    r = random.Random(hash(("p",) + prefix))
    u = r.random()
    if u < 0.1:
        return None
    _, _, t1, t2 = top2(world(prefix))
    if u < 0.55:
        return int(t2)
    if u < 0.85:
        return int(t1)
    return r.randrange(V)


def oracle_token(rule: Rule, z: torch.Tensor, prop: int | None, t: int, seed: int, temperature: float,
                 state: dict) -> int:
    """The rule at one position, from its formula: the proposal when the rule keeps it,
    else the target's own token (greedy: its top-1; sampling: the position's draw)."""
    if temperature == 0:
        own = int(z.argmax())
        p = torch.softmax(z, -1)
    else:
        p = sampling_probs(z.view(1, V), temperature)[0]
        own = int(coupled_draw(p.view(1, V), position_keys(torch.tensor([seed]), torch.tensor([t])))[0])
    if prop is None:
        state["regret"] = 0.0
        return own
    relax_ok = state["relaxed"] < state["budget"]
    keep = prop == own
    relaxed = False
    if not keep and relax_ok:
        if rule.name == MARS:
            z1, z2, t1, t2 = top2(z)
            stat = float(margin_statistic(z1.view(1), z2.view(1), rule.margin)[0])
            relaxed = stat > rule.theta and prop in (int(t1), int(t2)) and float(p[prop]) > 0
        elif rule.name == RATIO:
            relaxed = float(p[prop]) >= rule.rho * float(p.max()) and float(p[prop]) > 0
        elif rule.name == TOPK:
            rank = 1 + int((z > z[prop]).sum())
            relaxed = rank <= rule.top_n and float(p[prop]) >= float(p.max()) - rule.delta and float(p[prop]) > 0
        elif rule.name == REGRET:
            relaxed = state["regret"] + float(z.max() - z[prop]) <= rule.budget
    if rule.name == REGRET:
        state["regret"] = state["regret"] + float(z.max() - z[prop]) if (keep or relaxed) else 0.0
    if relaxed:
        state["relaxed"] += 1
        return prop
    return prop if keep else own


def oracle(rule: Rule, prompt: tuple[int, ...], n: int, seed: int, temperature: float, budget: float) -> list[int]:
    out: list[int] = []
    state = {"relaxed": 0, "budget": budget, "regret": 0.0}
    for t in range(n):
        prefix = prompt + tuple(out)
        out.append(oracle_token(rule, world(prefix), proposer(prefix), t, seed, temperature, state))
    return out


def speculative(rule: Rule, prompt: tuple[int, ...], n: int, seed: int, temperature: float, budget: float,
                schedule: random.Random) -> list[int]:
    out: list[int] = []
    relaxed = 0
    carry = 0.0
    while len(out) < n:
        prefix = prompt + tuple(out)
        chain: list[int] = []
        for _ in range(min(schedule.randrange(0, 5), n - len(out) - 1)):
            x = proposer(prefix + tuple(chain))
            if x is None:
                break
            chain.append(x)
        nxt = proposer(prefix + tuple(chain))
        k = len(chain)
        logits = torch.stack([world(prefix + tuple(chain[:j])) for j in range(k + 1)]).unsqueeze(0)
        left = None if budget == math.inf else torch.tensor([int(budget) - relaxed])
        res = verify(torch.tensor([chain], dtype=torch.long).view(1, k), logits, rule=rule,
                     temperature=temperature, bonus=torch.tensor([NO_PROPOSAL if nxt is None else nxt]),
                     seeds=torch.tensor([seed]), positions=torch.tensor([len(out)]), relax_left=left,
                     regret_carry=torch.tensor([carry], dtype=torch.float64))
        m = int(res.num_accepted[0])
        out += chain[:m] + [int(res.next_token[0])]
        relaxed += int(res.relaxed[0, : m + 1].sum())
        if res.regret is not None:
            carry = float(res.regret[0])
    return out[:n]


RULES = [(Rule(MARS, 0.9), 0.0), (Rule(MARS, 0.5, "prob-ratio"), 0.0), (Rule(MARS, 0.9), 0.8),
         (Rule(RATIO, rho=0.5), 0.0), (Rule(RATIO, rho=0.5), 1.0), (Rule(TOPK, top_n=2, delta=0.3), 0.7),
         (Rule(REGRET, budget=1.5), 0.0), (Rule(STRICT), 0.9)]


@pytest.mark.parametrize("rule,temperature", RULES, ids=[f"{r.label()}-T{t}" for r, t in RULES])
@pytest.mark.parametrize("budget", [math.inf, 3])
def test_any_schedule_computes_the_position_wise_text(rule, temperature, budget):
    for case in range(6):
        prompt = tuple(random.Random(case).randrange(V) for _ in range(3))
        want = oracle(rule, prompt, 30, seed=case, temperature=temperature, budget=budget)
        for sched in range(3):
            got = speculative(rule, prompt, 30, case, temperature, budget, random.Random(100 * case + sched))
            assert got == want, (case, sched)
    if rule.relaxes:  # the toy world really relaxes (or the test would prove little)
        state = {"relaxed": 0, "budget": math.inf, "regret": 0.0}
        for t in range(30):
            oracle_token(rule, world((t,)), proposer((t,)), t, 0, temperature, state)
        assert state["relaxed"] > 0


def test_strict_sampling_is_the_draws_whatever_the_drafts():
    """Strict sampling emits the position's draw at every position: random drafts, a bonus
    or none, give the same tokens as no drafts at all."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 6, V, generator=g) * 2  # [B, K+1, V]
    p = sampling_probs(logits, 0.9)
    seeds, pos = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 7, 3, 50])
    draws = sampled_draws(p, seeds, pos)  # [B, K+1]
    for trial in range(20):
        r = random.Random(trial)
        drafts = torch.tensor([[int(draws[b, j]) if r.random() < 0.7 else r.randrange(V) for j in range(5)]
                               for b in range(4)])
        bonus = torch.tensor([r.randrange(V) for _ in range(4)])
        res = verify(drafts, logits, rule=Rule(STRICT), temperature=0.9, seeds=seeds, positions=pos, bonus=bonus)
        for b in range(4):
            n = int(res.num_accepted[b])
            emitted = drafts[b, :n].tolist() + [int(res.next_token[b])]
            assert emitted == draws[b, : n + 1].tolist()
            assert not bool(res.relaxed[b].any())


def rows(*ps: list[float]) -> torch.Tensor:
    """Logits [1, K+1, V] whose softmax rows are the given probabilities over V tokens."""
    t = torch.zeros(len(ps), V, dtype=torch.float64)
    for i, p in enumerate(ps):
        t[i, : len(p)] = torch.tensor(p, dtype=torch.float64)
    return torch.where(t > 0, t.clamp(min=1e-300).log(), torch.full_like(t, -math.inf)).float().unsqueeze(0)


CLOSE = [0.45, 0.44, 0.11]  # token 0 top-1, token 1 a close top-2 (prob-ratio 0.98)
SURE = [0.9, 0.05, 0.05]


@pytest.mark.parametrize("bonus,want,relaxed", [(1, 1, True), (0, 0, False), (2, 0, False), (NO_PROPOSAL, 0, False)])
def test_the_position_after_the_drafts_judges_its_proposal(bonus, want, relaxed):
    """All drafts accepted: the next token is the rule's verdict on the bonus proposal: the
    top-2 kept at a close call (relaxed), the top-1 kept (strict), a top-3 replaced, none:
    the target's own (Algorithm 1)."""
    res = verify(torch.tensor([[0]]), rows(SURE, CLOSE), rule=Rule(MARS, 0.9, "prob-ratio"),
                 bonus=torch.tensor([bonus]))
    assert int(res.num_accepted[0]) == 1 and int(res.next_token[0]) == want
    assert res.relaxed[0].tolist() == [False, relaxed]


def test_a_step_that_drafts_nothing_judges_its_proposal():
    res = verify(torch.zeros(1, 0, dtype=torch.long), rows(CLOSE), rule=Rule(MARS, 0.9, "prob-ratio"),
                 bonus=torch.tensor([1]))
    assert int(res.next_token[0]) == 1 and res.relaxed[0].tolist() == [True]


def test_after_a_rejection_the_bonus_is_not_judged():
    """A rejected draft ends the step at its own position: the bonus proposal (for a later
    position) plays no part."""
    res = verify(torch.tensor([[2, 1]]), rows(SURE, CLOSE, CLOSE), rule=Rule(MARS, 0.9, "prob-ratio"),
                 bonus=torch.tensor([1]))
    assert int(res.num_accepted[0]) == 0 and int(res.next_token[0]) == 0
    assert not bool(res.relaxed.any())


def test_the_guard_and_the_budget_reach_the_position_after_the_drafts():
    rule = Rule(MARS, 0.9, "prob-ratio")
    logits = rows(CLOSE, CLOSE)
    guarded = verify(torch.tensor([[0]]), logits, rule=rule, bonus=torch.tensor([1]),
                     guard=torch.tensor([[False, True]]))
    assert int(guarded.next_token[0]) == 0 and bool(guarded.refused[0])
    spent = verify(torch.tensor([[1]]), logits, rule=rule, bonus=torch.tensor([1]), relax_left=torch.tensor([1]))
    assert int(spent.num_accepted[0]) == 1 and int(spent.next_token[0]) == 0  # the draft took the last one
    assert spent.relaxed[0].tolist() == [True, False] and bool(spent.refused[0])
    free = verify(torch.tensor([[1]]), logits, rule=rule, bonus=torch.tensor([1]), relax_left=torch.tensor([2]))
    assert free.relaxed[0].tolist() == [True, True] and int(free.next_token[0]) == 1


def test_sampled_mars_keeps_a_top_two_proposal_and_draws_otherwise():
    """At a relaxed position a sampled MARS row emits a top-two proposal outright (where the
    reference code rejects it); any other proposal gives way to the position's draw."""
    rule = Rule(MARS, 0.9, "prob-ratio")
    logits = rows(CLOSE)
    seeds, pos = torch.arange(200), torch.zeros(200, dtype=torch.long)
    p = sampling_probs(logits.expand(200, 1, V), 1.0)
    draws = sampled_draws(p, seeds, pos)[:, 0]
    none = torch.zeros(200, 0, dtype=torch.long)
    top2_res = verify(none, logits.expand(200, 1, V), rule=rule, temperature=1.0, seeds=seeds, positions=pos,
                      bonus=torch.full((200,), 1))
    assert (top2_res.next_token == 1).all()
    assert top2_res.relaxed[:, 0].tolist() == (draws != 1).tolist()
    other = verify(none, logits.expand(200, 1, V), rule=rule, temperature=1.0, seeds=seeds, positions=pos,
                   bonus=torch.full((200,), 2))
    assert other.next_token.tolist() == draws.tolist()
