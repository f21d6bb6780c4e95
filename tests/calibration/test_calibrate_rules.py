"""Calibrating every rule (issue 14): one collection serves all rules; the replay of each rule
equals its chain verifier on the recorded logits, greedy and sampled, the proposal after
each step's drafts included (with the loop guard and the relaxation budget); the policies
pick the right knob on hand-made data; a profile per rule round-trips and old profiles
still load as mars; match_relax_rate sets every rule to the same relax rate."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

from marscli.calibration.collect import MarginCollector, MarginData
from marscli.calibration.policies import (
    RuleFamily,
    analyse,
    critical_values,
    curve_values,
    match_relax_rate,
    pick_knob,
    relax_rate,
    rule_curve,
    walk,
)
from marscli.calibration.profiles import (
    ProfileError,
    default_profile_name,
    drafter_description,
    find_matching_profile,
    load_profile,
    save_profile,
    user_profile_dir,
)
from marscli.calibration.report import build_profile
from marscli.config import DraftConfig, GuardConfig, SamplingParams
from marscli.drafters.base import RowDrafters
from marscli.engine.scheduler import Engine
from marscli.engine.sequence import StepObservation
from marscli.verification.chain import NO_PROPOSAL, verify
from marscli.verification.registry import MARS, RATIO, REGRET, STRICT, TOPK, TYPICAL, Rule
from tests.engines import RankDrafter
from tests.helpers import STEP_V as V
from tests.helpers import _step
from tests.verify_helpers import toward_strict

K = 5

#: Each rule at several knob values, from strict-ish to very relaxed.
RULES_AT = {
    MARS: [Rule(MARS, t) for t in (0.0, 0.5, 0.9)] + [Rule(MARS, 0.3, "prob-ratio")],
    RATIO: [Rule(RATIO, rho=r) for r in (0.05, 0.3, 0.7, 1.0)],
    TOPK: [Rule(TOPK, top_n=n, delta=d) for n, d in ((2, 0.05), (2, 0.3), (3, 0.2), (5, 1.0))],
    TYPICAL: [Rule(TYPICAL, epsilon=e) for e in (0.01, 0.09, 0.3, 1.0)] + [Rule(TYPICAL, epsilon=0.2, alpha=0.05)],
    REGRET: [Rule(REGRET, budget=b) for b in (0.0, 0.5, 2.0, 6.0)],
}
ALL_RULES = [r for rs in RULES_AT.values() for r in rs]


@dataclass
class Step:
    """One chain step of a record, made by hand: the drafts, the target's logits, the
    drafter's proposal for the position after the drafts, and the loop guard's verdicts."""

    drafts: torch.Tensor  # [1, k] long, 0 <= k <= K
    logits: torch.Tensor  # [1, k+1, V]
    bonus: int  # the proposal after the drafts (NO_PROPOSAL: none)
    record: int = 0
    guard: torch.Tensor | None = None  # [1, k+1] bool
    position: int = 0  # output position of logits row 0 on the strict trajectory (_collect sets it)


def _random_steps(n: int, seed: int, sampled: bool = False, records: int = 1, guard: float = 0.0) -> list[Step]:
    """n steps over ``records`` records (in order): mostly K drafts, sometimes fewer or none,
    mixing the target's top-1, top-2 and other tokens (tests.helpers._step), and a proposal
    after them for most steps (the target's top-1 or top-2 mostly); each position guarded
    with probability ``guard``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        d, lg = _step(gen, scale=1.5 if sampled else 3.0)
        k = K if torch.rand(1, generator=gen) < 0.6 else int(torch.randint(0, K, (1,), generator=gen))
        d, lg = d[:, :k], lg[:, : k + 1]
        order = lg[0, k].argsort(descending=True)
        pick = int(torch.randint(0, 10, (1,), generator=gen))
        bonus = NO_PROPOSAL if pick < 2 else int(order[0 if pick < 5 else 1 if pick < 9 else 3])
        gd = torch.rand(1, k + 1, generator=gen) < guard if guard else None
        out.append(Step(d, lg, bonus, record=i * records // n, guard=gd))
    return out


def _record_sampling(sampling: SamplingParams, record: int) -> SamplingParams:
    """Each record's settings: its own seed and max tokens (the base of its budget)."""
    return replace(sampling, seed=sampling.seed + record, max_tokens=sampling.max_tokens + 20 * record)


def _verify(step: Step, rule: Rule, sampling: SamplingParams, **kw):
    """``verify`` of one step by ``rule`` with its proposal after the drafts; sampled with
    the record's seed at the step's output position."""
    s = _record_sampling(sampling, step.record)
    sampled = not s.greedy
    return verify(step.drafts, step.logits, rule=rule, temperature=s.temperature, bonus=torch.tensor([step.bonus]),
                  seeds=torch.tensor([s.seed]) if sampled else None,
                  positions=torch.tensor([step.position]) if sampled else None, **kw)


def _collect(steps: list[Step], sampling: SamplingParams) -> MarginCollector:
    """A strict run over ``steps`` as the calibrating engine shows it to calibration: one
    collector per record (its steps' strict verdicts, the proposal after the drafts and the
    guard's verdicts), merged in input order. Sets each step's output position."""
    merged, col, at = MarginCollector(), None, 0
    for i, step in enumerate(steps):
        if i == 0 or step.record != steps[i - 1].record:
            if col is not None:
                merged.extend(col)
            col, at = MarginCollector(), 0
        step.position = at
        res = _verify(step, Rule(), sampling)
        emitted = int(res.num_accepted[0]) + 1
        col(StepObservation(step.drafts, step.logits, res, _record_sampling(sampling, step.record), emitted,
                            next_proposal=None if step.bonus == NO_PROPOSAL else step.bonus, guard=step.guard))
        at += emitted
    if col is not None:
        merged.extend(col)
    return merged


def _verifier_run(steps: list[Step], rule: Rule, sampling: SamplingParams, guard: GuardConfig | None = None):
    """Every step verified by ``rule`` (the record's seed and the step's position when
    sampled), with the step's loop guard verdicts and the record's relaxation budget when
    ``guard`` is given: each record's relaxations so far counted from the verdicts. The
    regret sum starts afresh at each step (no regret_carry), as the replay has it."""
    out, made = [], 0
    for i, step in enumerate(steps):
        if i == 0 or step.record != steps[i - 1].record:
            made = 0
        kw = {}
        if guard is not None:
            budget = guard.budget(_record_sampling(sampling, step.record).max_tokens)
            kw = dict(guard=step.guard, relax_left=None if budget is None else torch.tensor([max(budget - made, 0)]))
        r = _verify(step, rule, sampling, **kw)
        made += int(r.relaxed.sum())
        out.append(r)
    return out


def _assert_replay_is_the_verifier(data: MarginData, steps: list[Step], rule: Rule, want: list,
                                   relaxable: bool = True) -> None:
    """The replay of ``rule``: each step's accepted drafts, the relaxed tokens (the position
    after the drafts included), the tokens emitted and (``relaxable``) the relaxable
    positions are the verifier's."""
    rep = data.replay(rule)
    label = rule.label()
    assert rep.num_accepted.tolist() == [int(r.num_accepted[0]) for r in want], label
    assert rep.relaxed == sum(int(r.relaxed.sum()) for r in want), label
    assert rep.emitted == sum(len(r.emitted(s.drafts, 0)) for r, s in zip(want, steps)), label
    if relaxable:
        count = sum(int(r.relaxable.sum()) for r in want)
        assert rep.relaxable_share == pytest.approx(count / data.positions), label


def _judged(steps: list[Step]) -> int:
    """Positions the steps judged: the drafts, and each proposal after them."""
    return sum(s.drafts.shape[1] + (s.bonus != NO_PROPOSAL) for s in steps)


# --------------------------------------------------------------------------- replay == verifier


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.label() + ("" if r.name != MARS else r.margin))
def test_greedy_replay_equals_the_chain_verifier(rule):
    steps = _random_steps(150, seed=5)
    data = _collect(steps, SamplingParams()).data(records=1)
    assert data.positions == _judged(steps) and data.step_bonus.tolist() == [s.bonus != NO_PROPOSAL for s in steps]
    want = _verifier_run(steps, rule, SamplingParams())
    _assert_replay_is_the_verifier(data, steps, rule, want)
    if rule.relaxes and rule != Rule(REGRET, budget=0.0):  # the comparison saw relaxations
        assert sum(int(r.relaxed.sum()) for r in want) > 0


@pytest.mark.parametrize("rule", [r for r in ALL_RULES if r.name != REGRET], ids=lambda r: r.label())
def test_sampling_replay_equals_the_chain_verifier(rule):
    """Two sampled records (each its own seed, positions from 0): strict keeps a proposal
    where it is the position's draw, the others where it is or their condition holds."""
    steps = _random_steps(150, seed=6, sampled=True, records=2)
    sp = SamplingParams(temperature=0.8, seed=11)
    data = _collect(steps, sp).data(records=2)
    assert data.sampled and data.positions == _judged(steps)
    want = _verifier_run(steps, rule, sp)
    _assert_replay_is_the_verifier(data, steps, rule, want)
    if rule.relaxes:  # the comparison saw relaxations
        assert sum(int(r.relaxed.sum()) for r in want) > 0


def test_regret_refuses_sampled_data():
    data = _collect(_random_steps(5, seed=1, sampled=True), SamplingParams(temperature=0.8)).data(records=1)
    with pytest.raises(ValueError, match="greedy"):
        data.replay(Rule(REGRET, budget=1.0))


GUARDED = [(name, 0.0) for name in (MARS, RATIO, TOPK, TYPICAL, REGRET)] + \
    [(name, 0.8) for name in (MARS, RATIO, TOPK, TYPICAL)]  # regret: greedy only


@pytest.mark.parametrize("name,temperature", GUARDED, ids=[f"{n}-T{t}" for n, t in GUARDED])
def test_replay_with_guard_and_budget_equals_the_guarded_verifier(name, temperature):
    """Two records, each with its own budget; the guard's verdicts at every position, the
    one after the drafts included. (With a budget, the relaxable positions past a step's
    first rejection may differ: the verifier counts a would-be relaxation the loop guard
    refuses against the budget of the positions after it, the replay does not. Those
    positions decide nothing; every reached one agrees.)"""
    steps = _random_steps(200, seed=7, sampled=bool(temperature), records=2, guard=0.3)
    sp = SamplingParams(temperature=temperature, max_tokens=100, seed=4)
    col = _collect(steps, sp)
    relaxed = {}
    for share in (1.0, 0.05):
        g = GuardConfig(3, 64, share)
        data = col.data(records=2, guard=g)
        for rule in RULES_AT[name][:3]:
            want = _verifier_run(steps, rule, sp, g)
            _assert_replay_is_the_verifier(data, steps, rule, want, relaxable=share == 1.0)
            relaxed[share, rule] = data.replay(rule).relaxed
    # The budget bites: 5 and 6 relaxations for the two records, fewer than without it.
    assert any(relaxed[0.05, r] < relaxed[1.0, r] for r in RULES_AT[name][:3])
    assert all(relaxed[0.05, r] <= 5 + 6 for r in RULES_AT[name][:3])


def test_the_regret_replay_sums_within_a_step_only():
    """An accepted approximation: the verifier carries the regret rule's sum across steps
    (regret_carry: a step that ends on a kept proposal after its drafts goes on summing),
    calibration's replay starts each step afresh. Here the first step's proposal (a top-2 of
    regret 1) is relaxed; the next step's top-2 draft (regret 1 again) fits the budget 1.5
    on its own, as the replay has it, not after the carried 1, as the verifier has it."""
    z = torch.zeros(V)
    z[3], z[4] = 5.0, 4.0  # top-1 token 3, top-2 token 4: regret z1 - z2 = 1
    first = Step(torch.zeros(1, 0, dtype=torch.long), z.view(1, 1, V).clone(), 4)
    second = Step(torch.tensor([[4]]), z.expand(1, 2, V).clone(), NO_PROPOSAL)
    data = _collect([first, second], SamplingParams()).data(records=1)
    rule = Rule(REGRET, budget=1.5)
    rep = data.replay(rule)
    assert rep.num_accepted.tolist() == [0, 1] and rep.relaxed == 2
    a = verify(first.drafts, first.logits, rule=rule, bonus=torch.tensor([4]),
               regret_carry=torch.zeros(1, dtype=torch.float64))
    assert int(a.next_token[0]) == 4 and float(a.regret[0]) == pytest.approx(1.0)
    b = verify(second.drafts, second.logits, rule=rule, bonus=torch.tensor([NO_PROPOSAL]), regret_carry=a.regret)
    assert int(b.num_accepted[0]) == 0  # carried: 1 + 1 > 1.5
    fresh = verify(second.drafts, second.logits, rule=rule, bonus=torch.tensor([NO_PROPOSAL]))
    assert int(fresh.num_accepted[0]) == 1  # what the replay judges


PROMPTS = ["the quick brown fox jumps over the lazy dog", "one two three four five six seven",
           "a margin aware rule for all", "hello world, hello there"]


class Recorder(MarginCollector):
    """A collector that also keeps each step (drafts, logits, the proposal after the
    drafts), to verify it again."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[Step] = []

    def __call__(self, obs) -> None:
        super().__call__(obs)
        nxt = NO_PROPOSAL if obs.next_proposal is None else obs.next_proposal
        self.seen.append(Step(obs.drafts.clone(), obs.logits.clone(), nxt))


@pytest.fixture(scope="module")
def collected(target):
    """Strict greedy runs of the tiny model with a drafter offering ranks 1, 2, 3, the
    engine calibrating (proposing after each step's drafts, as a relaxed rule's engine
    does): each record's recorder, and the merged data."""
    k = 3
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RankDrafter(target.model, k)), Rule(), cfg, calibrating=True)
    merged, recorders = MarginCollector(), []
    for text in PROMPTS:
        rec = Recorder()
        engine.generate_ids(target.tokenizer(text).input_ids, SamplingParams(max_tokens=30), observer=rec)
        recorders.append(rec)
        merged.extend(rec)
    return recorders, merged.data(records=len(PROMPTS))


@pytest.mark.parametrize("name", [MARS, RATIO, TOPK, TYPICAL, REGRET])
def test_replay_of_a_tiny_model_run_equals_the_verifier(collected, name):
    recorders, data = collected
    seen = [s for rec in recorders for s in rec.seen]
    assert data.steps == len(seen) and data.positions > 50
    assert data.positions == _judged(seen) and data.step_bonus.sum() > 0  # the engine proposed after the drafts
    assert (data.target_rank >= 3).any() and (data.target_rank == 2).any()  # ranks 1, 2, 3 offered
    relaxed_any = False
    for rule in RULES_AT[name]:
        want = _verifier_run(seen, rule, SamplingParams())
        _assert_replay_is_the_verifier(data, seen, rule, want)
        relaxed_any |= data.replay(rule).relaxed > 0
    assert relaxed_any  # the comparison saw relaxations


def test_collected_facts_are_the_rules_facts(collected):
    _, data = collected
    assert np.allclose(data.p_draft, np.exp(data.logp_draft), rtol=1e-5)
    assert np.allclose(data.p1, np.exp(data.logp1), rtol=1e-5)
    assert np.allclose(data.regret, data.z1 - data.z_draft)
    assert ((data.target_rank == 1) == (data.rank == 1)).all()
    assert (data.entropy >= 0).all() and np.isfinite(data.entropy).all()


@pytest.mark.parametrize("name", [MARS, RATIO, TOPK, TYPICAL, REGRET])
def test_match_relax_rate_gives_every_rule_the_same_share(collected, name):
    _, data = collected
    P = data.positions
    template = {MARS: Rule(MARS, 0.9), RATIO: Rule(RATIO, rho=0.5), TOPK: Rule(TOPK, top_n=3, delta=0.1),
                # alpha = inf: p(x) > epsilon. (With alpha tied to sqrt(epsilon) the tiny random
                # model's near-uniform p relaxes every draft even at epsilon = 1: nothing to match.)
                TYPICAL: Rule(TYPICAL, epsilon=0.09, alpha=math.inf), REGRET: Rule(REGRET, budget=1.0)}[name]
    family = RuleFamily.of(template)
    vals = critical_values(data, family)
    most = data.replay(family.at(vals[-1] if len(vals) else family.strict_end)).relaxing
    floor = data.replay(family.at(family.strict_end)).relaxing  # typical relaxes at epsilon 1
    tried = 0
    for share in (0.02, 0.05, 0.1):
        if not floor <= share * P <= most:
            continue
        tried += 1
        (rule,) = match_relax_rate(data, [template], share)
        assert rule.name == name
        rep = data.replay(rule)
        assert rep.relax_rate <= share
        assert rep.relaxing >= math.floor(share * P + 1e-9) - 1, (share, rule.label(), rep.relaxing)
    assert tried  # some share was within the rule's reach on these data
    assert match_relax_rate(data, [Rule(STRICT)], 0.1) == [Rule(STRICT)]


# --------------------------------------------------------------------------- policies, hand-made


def handmade(n_steps: int = 300, k: int = 4, seed: int = 0) -> MarginData:
    """Greedy-like data with every fact: ranks 1-4, p(x), p1, entropy and regret."""
    rng = np.random.default_rng(seed)
    P = n_steps * k
    rank = rng.choice([1, 2, 3, 4], size=P, p=[0.5, 0.3, 0.1, 0.1])
    p1 = rng.uniform(0.3, 0.9, size=P)
    px = np.where(rank == 1, p1, p1 * rng.uniform(0.01, 0.99, size=P))
    logp1, logpd = np.log(p1), np.log(px)
    strict_ok = (rank == 1).astype(float)
    ok = strict_ok.reshape(n_steps, k)
    n = np.cumprod(ok, axis=1).sum(axis=1)
    return MarginData(
        step_k=np.full(n_steps, k), step_n=n.astype(np.int64), tokens=int(n.sum() + n_steps),
        records=10, failed_records=0, logit_ratio=rng.uniform(0.5, 1.0, size=P), prob_ratio=px / p1,
        z1=np.full(P, 10.0), rank=np.minimum(rank, 3).astype(float), logp1=logp1, logp2=logpd,
        logp_draft=logpd, strict_ok=strict_ok, target_rank=rank.astype(float),
        entropy=rng.uniform(0.1, 3.0, size=P),
    )


FAMILIES = [RuleFamily.of(Rule(MARS, 0.9)), RuleFamily.of(Rule(RATIO, rho=0.5)),
            RuleFamily.of(Rule(TOPK, top_n=3, delta=0.1)), RuleFamily.of(Rule(TYPICAL, epsilon=0.09)),
            RuleFamily(Rule(TYPICAL, epsilon=0.09, alpha=0.2)), RuleFamily.of(Rule(REGRET, budget=1.0))]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.template.label())
def test_replay_is_monotone_in_the_knob(family):
    data = handmade()
    values = list(critical_values(data, family))[::7]  # from the strict end outwards
    reps = [data.replay(family.at(float(v))) for v in values]
    relaxing = [r.relaxing for r in reps]
    totals = [r.nll_increase * r.emitted for r in reps]
    taus = [r.tau for r in reps]
    assert relaxing == sorted(relaxing) and relaxing[-1] > relaxing[0]
    assert all(a <= b + 1e-9 for a, b in zip(totals, totals[1:]))
    assert taus == sorted(taus)


@pytest.mark.parametrize("family", FAMILIES[1:], ids=lambda f: f.template.label())
@pytest.mark.parametrize("eps", [0.0, 0.01, 0.05, 0.3])
def test_max_nll_increase_picks_the_most_relaxing_knob_within_budget(family, eps):
    data = handmade()
    # typical with alpha tied to sqrt(epsilon) relaxes even at epsilon = 1: its cost floor
    floor = data.replay(family.at(family.strict_end)).nll_increase if family.name == TYPICAL else 0.0
    best = walk(data, family, lambda r: r.nll_increase <= eps)
    knob = pick_knob(data, family, "max-nll-increase", eps)
    assert toward_strict(family, knob, best)  # rounding only ever moves towards strict...
    assert abs(knob - best) <= 1e-4
    assert data.replay(family.at(knob)).nll_increase <= max(eps, floor)  # ...keeping the promise
    vals = critical_values(data, family)
    inside = [v for v in vals if toward_strict(family, v, best)]
    assert all(data.replay(family.at(float(v))).nll_increase <= eps for v in inside[::11])
    beyond = [v for v in vals if not toward_strict(family, v, best)]
    if beyond and floor <= eps:  # one step further breaks the budget
        assert data.replay(family.at(float(beyond[0]))).nll_increase > eps


@pytest.mark.parametrize("family", FAMILIES[1:], ids=lambda f: f.template.label())
@pytest.mark.parametrize("share", [0.0, 0.03, 0.1, 0.2])
def test_relax_rate_picks_the_knob_relaxing_that_share(family, share):
    data = handmade()
    floor = data.replay(family.at(family.strict_end)).relaxing
    rep = data.replay(family.at(pick_knob(data, family, "relax-rate", share)))
    assert rep.relax_rate <= share or rep.relaxing == floor
    best = data.replay(family.at(walk(data, family, lambda r: r.relax_rate <= share)))
    most = data.replay(family.at(float(critical_values(data, family)[-1]))).relaxing
    want = min(math.floor(share * data.positions + 1e-9), most)
    if floor <= want:
        assert want - 1 <= best.relaxing <= want  # no ties in these data: within one position
    assert relax_rate(data, family.at(pick_knob(data, family, "fixed", 0.5))) == \
        data.replay(family.at(0.5)).relax_rate


def test_relax_rate_counts_only_positions_strict_rejects():
    # Two steps of two positions: a top-1 draft (strict accepts it) and a runner-up at
    # p(x) / p1 = 0.8; ratio at rho 0.5 relaxes the runner-up only, whatever the top-1 does.
    p1 = np.array([0.6, 0.5, 0.6, 0.5])
    px = np.array([0.6, 0.4, 0.6, 0.4])
    data = MarginData(
        step_k=np.array([2, 2]), step_n=np.array([1, 1]), tokens=4, records=1, failed_records=0,
        logit_ratio=np.full(4, 0.9), prob_ratio=px / p1, z1=np.full(4, 5.0), rank=np.array([1.0, 2, 1, 2]),
        logp1=np.log(p1), logp2=np.log(px), logp_draft=np.log(px), strict_ok=np.array([1.0, 0, 1, 0]),
        p_draft=px, p1=p1, entropy=np.full(4, 1.0))
    rep = data.replay(Rule(RATIO, rho=0.5))
    assert rep.relaxable_share == 1.0  # the condition holds at every position...
    assert rep.relax_rate == 0.5 and rep.relaxing == 2  # ...but only the runner-ups are relaxations
    assert rep.num_accepted.tolist() == [2, 2] and rep.relaxed == 2
    assert rep.nll_increase == pytest.approx(2 * math.log(0.5 / 0.4) / 6)
    assert data.replay(Rule(RATIO, rho=0.9)).relax_rate == 0.0
    assert pick_knob(data, RuleFamily.of(Rule(RATIO)), "relax-rate", 0.5) == 0.8
    assert pick_knob(data, RuleFamily.of(Rule(RATIO)), "relax-rate", 0.4) == 1.0  # strict


def test_the_position_after_the_drafts_ends_its_step():
    """Each step's last position is the proposal after its drafts (step_bonus): kept, it is
    the step's last token (no draft more: min(kept, k) drafts accepted, one token after
    them), relaxed only when every draft was kept; after a rejected draft it decides
    nothing, though the relax rate, judging every position on its own, counts it."""
    # Step 0: a top-1 draft, then a runner-up (p(x) / p1 = 0.8) after it. Step 1: a runner-up
    # draft at 0.2, then a runner-up at 0.8. Ratio at rho 0.5 relaxes the 0.8s only.
    p1 = np.full(4, 0.5)
    px = np.array([0.5, 0.4, 0.1, 0.4])
    data = MarginData(
        step_k=np.array([1, 1]), step_bonus=np.array([1, 1]), step_n=np.array([1, 0]), tokens=3, records=1,
        failed_records=0, logit_ratio=np.full(4, 0.9), prob_ratio=px / p1, z1=np.full(4, 5.0),
        rank=np.array([1.0, 2, 2, 2]), logp1=np.log(p1), logp2=np.log(px), logp_draft=np.log(px),
        strict_ok=np.array([1.0, 0, 0, 0]), p_draft=px, p1=p1, entropy=np.full(4, 1.0))
    assert data.positions == 4
    strict = data.replay(Rule(STRICT))
    assert strict.num_accepted.tolist() == [1, 0] and strict.emitted == 3 and strict.relaxed == 0
    rep = data.replay(Rule(RATIO, rho=0.5))
    assert rep.num_accepted.tolist() == [1, 0]  # the kept proposal after the drafts is no draft
    assert rep.emitted == 3 and rep.relaxed == 1  # step 0's last token, relaxed
    assert rep.relaxing == 2 and rep.relax_rate == 0.5  # step 1's counts, judged on its own
    assert rep.nll_increase == pytest.approx(math.log(0.5 / 0.4) / 3)
    loose = data.replay(Rule(RATIO, rho=0.1))  # step 1's draft relaxed too: its bonus then
    assert loose.num_accepted.tolist() == [1, 1] and loose.relaxed == 3 and loose.emitted == 4


def test_regret_budget_is_summed_along_the_step():
    # One step: runner-ups of regret 1.0 then 1.5 (summed 2.5): budget 2 keeps only the first.
    data = MarginData(
        step_k=np.array([2]), step_n=np.array([0]), tokens=1, records=1, failed_records=0,
        logit_ratio=np.full(2, 0.9), prob_ratio=np.full(2, 0.5), z1=np.full(2, 5.0), rank=np.full(2, 2.0),
        logp1=np.log([0.6, 0.6]), logp2=np.log([0.6, 0.6]) - [1.0, 1.5],
        logp_draft=np.log([0.6, 0.6]) - [1.0, 1.5], strict_ok=np.zeros(2), regret=np.array([1.0, 1.5]))
    assert data.replay(Rule(REGRET, budget=2.0)).num_accepted.tolist() == [1]
    assert data.replay(Rule(REGRET, budget=2.5)).num_accepted.tolist() == [2]
    assert critical_values(data, RuleFamily.of(Rule(REGRET))).tolist() == [1.0, 2.5]
    assert pick_knob(data, RuleFamily.of(Rule(REGRET)), "relax-rate", 0.5) == 1.0


def test_typical_alpha_follows_epsilon_unless_given():
    tied = RuleFamily.of(Rule(TYPICAL, epsilon=0.09))
    assert tied.tie_alpha and tied.at(0.25).alpha == pytest.approx(0.5)
    fixed = RuleFamily.of(Rule(TYPICAL, epsilon=0.09, alpha=0.2))
    assert not fixed.tie_alpha and fixed.at(0.25).alpha == 0.2
    assert RuleFamily.of(Rule(TYPICAL, epsilon=0.09), alpha_given=True).at(0.25).alpha == pytest.approx(0.3)


def test_typical_needs_the_entropy():
    from tests.helpers import synthetic

    with pytest.raises(ValueError, match="entropy"):
        synthetic().replay(Rule(TYPICAL, epsilon=0.1))


@pytest.mark.parametrize("family", FAMILIES[1:], ids=lambda f: f.template.label())
def test_curve_runs_from_most_relaxing_to_strict(family):
    data = handmade()
    rows = rule_curve(data, family, curve_values(data, family))
    assert rows[-1][family.knob] == math.inf and rows[-1]["relax_rate"] == 0 and rows[-1]["nll_increase"] == 0
    rates = [r["relax_rate"] for r in rows]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0


# --------------------------------------------------------------------------- profiles

IDENTITY = {
    "name": "Tiny", "source": "/models/tiny", "kind": "dir", "sha256": None,
    "fingerprint": "folder-v1:abc", "revision": None, "dtype": "float32", "quantization": None,
    "device": "cpu",
}


def _profile(rule: Rule | None, name: str, policy: str = "max-nll-increase", value: float = 0.02) -> dict:
    data = handmade()
    family = RuleFamily.mars("logit-ratio") if rule is None else RuleFamily.of(rule)
    cal = analyse(data, family, policy, value, seconds=1.0)
    return build_profile(name=name, cal=cal, data=data, target_identity=IDENTITY, draft_cfg=DraftConfig(),
                         draft_identity=None, sampling=SamplingParams(max_tokens=64), input_name="c.jsonl",
                         input_sha256=None, seconds=1.0)


@pytest.mark.parametrize("template", [Rule(MARS, 0.9), Rule(RATIO, rho=0.5), Rule(TOPK, top_n=3, delta=0.1),
                                      Rule(TYPICAL, epsilon=0.09), Rule(TYPICAL, epsilon=0.09, alpha=0.2),
                                      Rule(REGRET, budget=1.0)], ids=lambda r: r.label())
def test_a_profile_per_rule_round_trips(template, tmp_path):
    doc = _profile(template, f"tiny.ngram.float32.{template.name}")
    prof = save_profile(doc, tmp_path / "p.yaml")
    again = load_profile(tmp_path / "p.yaml")
    assert again.data == doc
    rule = again.rule
    assert rule.name == template.name and rule.relaxes
    assert rule.knobs() == {k: v for k, v in doc["verification"].items() if k != "guard" and k != "rule"}
    if template.name == TOPK:
        assert rule.top_n == 3  # the fixed knob is kept
    if template.name == TYPICAL and template.alpha == 0.2:
        assert rule.alpha == 0.2
    elif template.name == TYPICAL:
        assert rule.alpha == pytest.approx(math.sqrt(rule.epsilon))
    # The chosen knob keeps the budget on the data it was fitted on (typical with alpha tied:
    # unless even its least relaxing member, epsilon = 1, breaks it; then that is chosen).
    family = RuleFamily.of(template)
    floor = handmade().replay(family.at(family.strict_end)).nll_increase if template.name == TYPICAL else 0
    assert handmade().replay(rule).nll_increase <= max(0.02, floor)
    assert again.knob == (rule.knob[0], rule.knob[1]) and prof.rule_name == template.name
    if template.name != MARS:
        with pytest.raises(ProfileError, match="not mars"):
            _ = again.theta


def test_an_old_profile_without_rule_loads_as_mars(tmp_path):
    doc = _profile(None, "old")
    del doc["verification"]["rule"]
    for row in doc["curve"]:
        row.pop("relax_rate")
    doc["summary"].pop("relax_rate")
    prof = save_profile(doc, tmp_path / "old.yaml")
    assert prof.rule_name == MARS and prof.rule == Rule(MARS, prof.theta, "logit-ratio")


@pytest.mark.parametrize("edit,message", [
    (lambda v: v.update(rho=0.0), "verification.rho: must be in (0, 1], got 0.0"),
    (lambda v: v.update(rho=1.5), "verification.rho: must be in (0, 1], got 1.5"),
    (lambda v: v.update(theta=0.9), "verification.theta: not a knob of rule ratio"),
    (lambda v: v.pop("rho"), "verification.rho: missing (rule ratio)"),
    (lambda v: v.update(rule="fast"), "verification.rule: must be one of mars, ratio"),
])
def test_profile_knobs_are_checked(edit, message, tmp_path):
    doc = _profile(Rule(RATIO, rho=0.5), "r")
    edit(doc["verification"])
    with pytest.raises(ProfileError) as e:
        save_profile(doc, tmp_path / "bad.yaml")
    assert message in str(e.value) and "\n" not in str(e.value)


def test_profiles_of_several_rules_coexist_and_are_found():
    assert default_profile_name("SmolLM2-135M-Instruct", "ngram", None, "float32", None) == \
        "smollm2-135m-instruct.ngram.float32"
    assert default_profile_name("SmolLM2-135M-Instruct", "ngram", None, "float32", None, rule=RATIO) == \
        "smollm2-135m-instruct.ngram.float32.ratio"
    d = user_profile_dir()
    d.mkdir(parents=True, exist_ok=True)
    mars = _profile(Rule(MARS, 0.9), "tiny.ngram.float32")
    ratio = _profile(Rule(RATIO, rho=0.5), "tiny.ngram.float32.ratio")
    mars["created_at"], ratio["created_at"] = "2025-01-01T00:00:00+00:00", "2025-01-02T00:00:00+00:00"
    save_profile(mars, d / "tiny.ngram.float32.yaml")
    save_profile(ratio, d / "tiny.ngram.float32.ratio.yaml")
    drafter = drafter_description("ngram", None)
    assert find_matching_profile(IDENTITY, drafter).name == "tiny.ngram.float32.ratio"  # the newest
    assert find_matching_profile(IDENTITY, drafter, rule=MARS).name == "tiny.ngram.float32"
    assert find_matching_profile(IDENTITY, drafter, rule=TOPK) is None


# --------------------------------------------------------------------------- command line


def test_cli_calibrates_a_rule(runner, tiny_model_dir, calib_prompts, tmp_path):
    from marscli.cli import app

    out = tmp_path / "ratio.yaml"
    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                            "--rule", "ratio", "--relax-rate", "0.1", "-o", str(out), "--fixed-k"])
    assert r.exit_code == 0, r.stderr
    prof = load_profile(out)
    assert prof.rule_name == RATIO and prof.data["policy"] == {"name": "relax-rate", "value": 0.1}
    assert prof.data["summary"]["relax_rate"] <= 0.1
    assert "rho" in r.stderr and "relax rate" in r.stderr  # the curve's knob column
    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                            "--rule", "topk", "--delta", "0.2", "--top-n", "3", "-o", "-", "--quiet"])
    assert r.exit_code == 0, r.stderr
    assert "rule: topk" in r.stdout and "top_n: 3" in r.stdout and "delta: 0.2" in r.stdout
    bad = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                              "--rule", "ratio", "--theta", "0.9"])
    assert bad.exit_code == 2 and "--theta is not a knob of --rule ratio" in bad.stderr
    bad = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                              "--rule", "regret", "--temperature", "0.7"])
    assert bad.exit_code == 2 and "greedy decoding only" in bad.stderr


@pytest.fixture
def calib_prompts(tmp_path):
    rows = [{"id": f"c{i}", "prompt": p, "max_tokens": 24} for i, p in enumerate([
        "one two three one two three one two three one two",
        "the cat sat on the mat. the cat sat on the mat. the cat",
        "hello world, hello world, hello world, hello",
    ])]
    src = tmp_path / "calib.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return src


def test_api_calibrates_a_rule(tiny_model_dir):
    import marscli

    llm = marscli.load(str(tiny_model_dir))
    prompts = ["one two three one two three one two three", "hello world, hello world, hello"]
    prof = llm.calibrate(prompts, rule="topk", top_n=3, relax_rate=0.05, max_tokens=16)
    assert prof.rule_name == TOPK and prof.rule.top_n == 3
    assert prof.name.endswith(".topk") and prof.data["summary"]["relax_rate"] <= 0.05
    fixed = llm.calibrate(prompts, rule="regret", budget=1.5, max_tokens=16)
    assert fixed.rule == Rule(REGRET, budget=1.5) and fixed.data["policy"]["name"] == "fixed"


def test_generate_applies_a_profiles_rule_and_the_command_line_wins(runner, tiny_model_dir, calib_prompts, tmp_path):
    """calibrate --rule ratio -> profile -> generate: the profile's rule at its knob is the
    default; --rho replaces the knob; --verify naming another rule drops the profile's."""
    import json

    from marscli.cli import app

    prof = tmp_path / "ratio.yaml"
    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                            "--rule", "ratio", "--relax-rate", "0.2", "-o", str(prof), "--fixed-k", "--quiet"])
    assert r.exit_code == 0, r.stderr
    rho = load_profile(prof).rule.rho
    # the profile may predict that relaxing does not pay and verify strictly: take that out
    doc = load_profile(prof).data
    doc.get("speed", {})["verify_strictly"] = False
    save_profile(doc, prof)

    def spec(*extra):
        res = runner.invoke(app, ["generate", str(calib_prompts), "--target", str(tiny_model_dir),
                                  "--profile", str(prof), "--max-tokens", "6", "--limit", "1", *extra])
        assert res.exit_code == 0, res.stderr
        return json.loads(res.stdout.splitlines()[0])["spec"], res.stderr

    s, _ = spec()
    assert s["verify"] == "ratio" and s["knobs"] == {"rho": rho}
    s, _ = spec("--rho", "0.25")  # a knob of the profile's rule needs no --verify
    assert s["verify"] == "ratio" and s["knobs"] == {"rho": 0.25}
    s, _ = spec("--verify", "topk", "--delta", "0.1")
    assert s["verify"] == "topk" and s["knobs"] == {"top_n": 2, "delta": 0.1}
    s, err = spec("--verify", "mars")  # a ratio profile has no theta: the paper's
    assert s["verify"] == "mars" and s["theta"] == 0.9 and "paper's theta" in err
    bad = runner.invoke(app, ["generate", str(calib_prompts), "--target", str(tiny_model_dir),
                              "--profile", str(prof), "--delta", "0.1"])
    assert bad.exit_code == 2 and "--delta belongs to --verify topk, not --verify ratio" in bad.stderr


@pytest.mark.parametrize("name", [MARS, RATIO, TOPK, REGRET])
def test_match_by_relaxed_holds_the_replayed_relaxations_to_the_share(collected, name):
    """bench's matching (by=RELAXED): the relaxed drafts the replay accepts per verified
    position stay within the share, and one more critical value would break it."""
    from marscli.calibration.policies import RELAXED

    _, data = collected
    P = data.positions
    template = {MARS: Rule(MARS, 0.9), RATIO: Rule(RATIO, rho=0.5), TOPK: Rule(TOPK, top_n=3, delta=0.1),
                REGRET: Rule(REGRET, budget=1.0)}[name]
    family = RuleFamily.of(template)
    vals = [float(v) for v in critical_values(data, family)]
    most = data.replay(family.at(vals[-1])).relaxed if vals else 0
    share = min(0.05, 0.5 * most / P)
    assert share > 0  # the data leave something to match
    (rule,) = match_relax_rate(data, [template], share, by=RELAXED)
    assert data.replay(rule).relaxed / P <= share
    knob = rule.knob[1]
    later = [v for v in vals if toward_strict(family, knob, v) and v != knob]
    if later:  # the next, more relaxing critical value relaxes more than the share
        assert data.replay(family.at(later[0])).relaxed / P > share
    with pytest.raises(ValueError, match="match by"):
        match_relax_rate(data, [template], share, by="tokens")
