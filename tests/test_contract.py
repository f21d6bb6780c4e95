"""The reproducibility contract (issue 31, docs/verification.md): a record's text is a
function of the models, drafter, rule and knobs, guard and spans, sampling settings, seed and
the record itself, never of the batch size, its neighbours or measured step costs; relaxed
rules verify the first tokens of an output strictly and never decide where it ends.

Tiny float32 random models; the draft lengths are adaptive (the default), with step costs
that differ wildly between the runs compared.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from marscli.config import GUARD_OFF, DraftConfig, GuardConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import AcceptanceTracker, DrafterBase, Proposal, RowDrafters
from marscli.drafters.factory import build_drafter, build_drafters
from marscli.engine.costs import StepCosts, reference_costs, static_costs
from marscli.engine.provenance import RELAXED
from marscli.engine.scheduler import Engine
from marscli.verification.chain import verify
from marscli.verification.registry import MARS, RATIO, REGRET, STRICT, TOPK, TYPICAL, Rule, mode_problem
from marscli.verification.rules import stop_positions, top2
from marscli.verification.tree import DraftTree, verify_tree

PROMPTS = [
    "the quick brown fox jumps over the lazy dog",
    "x",
    "hello world, hello marscli; the cat sat on the mat. hello world, hello",
    "one two three four five six seven eight nine ten one two three",
    "speculative decoding drafts tokens and the target verifies them in one pass. " * 3,
]
#: Every rule at knobs that relax on the tiny model.
RULES = [Rule(STRICT), Rule(MARS, 0.3, "prob-ratio"), Rule(RATIO, rho=0.3), Rule(TOPK, top_n=3, delta=0.3),
         Rule(TYPICAL, epsilon=0.3), Rule(REGRET, budget=2.0)]
GUARD = GuardConfig(repeat_ngram=0, max_relaxed_share=1.0, strict_first=0, strict_stops=False)


class MixedDrafter(DrafterBase):
    """Proposes the target's own greedy path, with the target's runner-up at every third
    position of the output (so every rule has something to relax), keeps an acceptance
    estimate (so the engine chooses its draft lengths) and proposes a function of the
    committed sequence only."""

    name = "mixed"

    def __init__(self, model, k: int):
        self.model, self.k = model, k
        self.tracker = AcceptanceTracker()

    def start(self, prompt_ids, *_, **__):
        self.tracker = AcceptanceTracker()

    def offer(self, seq, k_max):
        return self.tracker.offer(min(self.k, k_max))

    def propose(self, seq, k):
        out, cur = [], list(seq)
        with torch.no_grad():
            for _ in range(k):
                _, _, t1, t2 = top2(self.model(torch.tensor([cur])).logits[0, -1])
                tok = int(t2 if len(cur) % 3 == 0 else t1)
                out.append(tok)
                cur.append(tok)
        return Proposal(out)

    def accepted(self, proposed, accepted, seq):
        self.tracker.update(proposed, accepted)


def wild_costs(slope: float) -> StepCosts:
    """A measured-looking curve whose slope makes drafting cheap (small) or dear (large)."""
    bs, ns = (1, 2, 4, 8), (1, 2, 3, 5, 9)
    return StepCosts(bs, ns, tuple(tuple(1.0 + slope * (b * n - 1) for n in ns) for b in bs),
                     tuple(0.05 * b for b in bs), {"test": slope}, "measured")


def make_engine(target, draft, kind: str, rule: Rule, batch_size: int, costs: StepCosts,
                guard: GuardConfig = GUARD) -> Engine:
    dcfg = DraftConfig(kind="model" if kind != "ngram" else "ngram", model="x", num_draft_tokens=4,
                       hybrid=kind == "hybrid", context=8 if kind == "window" else None)
    if kind == "mixed":
        drafters = RowDrafters(lambda: MixedDrafter(target.model, 4))
    elif kind in ("model", "hybrid", "window"):
        drafters = build_drafters(dcfg, target, draft, batch_size=batch_size)
    else:
        drafters = RowDrafters(lambda: build_drafter(dcfg, target))
    engine = Engine(target, drafters, rule, dcfg, batch_size, costs=costs, guard=guard)
    engine.reference = reference_costs(0.25 if kind != "ngram" else 0.0)
    return engine


def run_all(engine: Engine, target, items: list[tuple[str, SamplingParams]]) -> dict[int, object]:
    got = {}
    for i, res in engine.run(range(len(items)),
                             lambda i: (target.tokenizer(items[i][0]).input_ids, items[i][1])):
        assert not isinstance(res, Exception), res
        got[i] = res
    return got


def settings_for(rule: Rule, temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, top_p=0.95 if temperature else 1.0,
                           max_tokens=20 + 7 * (i % 3), seed=300 + i) for i in range(len(PROMPTS))]


CASES = [(r, t, kind) for r in RULES for t in (0.0, 0.9) if mode_problem(r.name, t) is None
         for kind in ("mixed", "ngram")] + [(Rule(MARS, 0.3, "prob-ratio"), 0.0, "model"),
                                            (Rule(STRICT), 0.9, "model"),
                                            # hybrid drafting: its source, like its lengths,
                                            # follows the reference curve for these rows
                                            (Rule(MARS, 0.3, "prob-ratio"), 0.0, "hybrid"),
                                            (Rule(STRICT), 0.9, "hybrid"),
                                            # a draft model reading an 8-token prompt window
                                            (Rule(MARS, 0.3, "prob-ratio"), 0.0, "window")]


@pytest.mark.parametrize("rule,temperature,kind", CASES,
                         ids=[f"{r.name}-{'greedy' if t == 0 else 'sampled'}-{k}" for r, t, k in CASES])
def test_a_record_alone_equals_it_in_a_batch_of_mixed_neighbours(target, draft, rule, temperature, kind):
    """Each record alone at batch size 1 with cheap drafting costs == the same record among
    neighbours of other prompts, budgets and temperatures, at batch size 3, in reverse
    order, with costs that make drafting dear: same tokens, same statistics."""
    samplings = settings_for(rule, temperature)
    items = list(zip(PROMPTS, samplings))
    alone = make_engine(target, draft, kind, rule, 1, wild_costs(0.001))
    ref = {i: alone.generate_ids(target.tokenizer(p).input_ids, s) for i, (p, s) in enumerate(items)}
    if rule.relaxes and kind == "mixed":
        assert sum(r.stats.relaxed for r in ref.values()) > 0, "the rule must really relax here"
    # Neighbours: the other temperature (where the rule has it) and other budgets, mixed in.
    other = 0.0 if temperature else (0.7 if mode_problem(rule.name, 0.7) is None else 0.0)
    neighbours = [(p[::-1] + " z", SamplingParams(temperature=other, max_tokens=9 + 5 * j, seed=j))
                  for j, p in enumerate(PROMPTS)]
    mixed = [x for pair in zip(reversed(items), neighbours) for x in pair]
    crowd = make_engine(target, draft, kind, rule, 3, wild_costs(2.0))
    got = run_all(crowd, target, mixed)
    n = len(items)
    for j in range(n):
        res, want = got[2 * j], ref[n - 1 - j]
        assert res.token_ids == want.token_ids, (n - 1 - j, want.token_ids, res.token_ids)
        if rule.relaxes or temperature:
            assert res.stats.to_dict() == want.stats.to_dict()


def test_strict_greedy_rows_keep_the_cost_aware_schedule(target, draft):
    """Strict greedy text cannot depend on draft lengths, so its rows still follow the
    measured costs: dear drafting at batch 3 drafts less (same text)."""
    items = list(zip(PROMPTS, settings_for(Rule(STRICT), 0.0)))
    cheap = run_all(make_engine(target, draft, "mixed", Rule(STRICT), 3, wild_costs(0.001)), target, items)
    dear = run_all(make_engine(target, draft, "mixed", Rule(STRICT), 3, wild_costs(2.0)), target, items)
    assert all(cheap[i].token_ids == dear[i].token_ids for i in cheap)
    assert sum(r.stats.drafted for r in dear.values()) < sum(r.stats.drafted for r in cheap.values())


def test_relaxed_rows_ignore_measured_costs(target, draft):
    """The same batch with cheap and dear measured costs: relaxed rows draft the same."""
    rule = Rule(MARS, 0.3, "prob-ratio")
    items = list(zip(PROMPTS, settings_for(rule, 0.0)))
    cheap = run_all(make_engine(target, draft, "mixed", rule, 3, wild_costs(0.001)), target, items)
    dear = run_all(make_engine(target, draft, "mixed", rule, 3, wild_costs(2.0)), target, items)
    for i in cheap:
        assert cheap[i].token_ids == dear[i].token_ids
        assert cheap[i].stats.drafted == dear[i].stats.drafted


def test_reference_curve_is_a_function_of_the_models_only(target, draft):
    ref = reference_costs(0.3)
    assert ref.step(1, 4) == pytest.approx(1.0 + 0.04 * 4 + 0.3 * 4)
    assert ref == reference_costs(0.3)
    from marscli.engine.costs import draft_ratio

    ratio = draft_ratio(target.model, draft)
    nbytes = lambda m: sum(p.numel() * p.element_size() for p in m.parameters())  # noqa: E731
    assert ratio == pytest.approx(nbytes(draft.model) / nbytes(target.model))
    assert draft_ratio(target.model, None) == 0.0
    assert static_costs("cuda").step(1, 4) != ref.step(1, 4)  # not the device's curve


# ---------------------------------------------------------------------------- strict first tokens


def relaxed_kinds(engine, target, items):
    out = []
    for p, s in items:
        res = engine.generate_ids(target.tokenizer(p).input_ids, dataclasses.replace(s, provenance=True))
        out.append(res.provenance["kinds"])
    return out


@pytest.mark.parametrize("rule", [Rule(MARS, 0.3, "prob-ratio"), Rule(RATIO, rho=0.3)], ids=["mars", "ratio"])
def test_strict_first_tokens_are_never_relaxed(target, draft, rule):
    items = [(p, SamplingParams(max_tokens=16)) for p in PROMPTS]

    def kinds(first: int) -> list[str]:
        guard = dataclasses.replace(GUARD, strict_first=first)
        return relaxed_kinds(make_engine(target, draft, "mixed", rule, 1, wild_costs(0.04), guard), target, items)

    off, two, five = kinds(0), kinds(2), kinds(5)
    assert any(RELAXED in k[:2] for k in off), "without strict first tokens the rule relaxes at once"
    assert not any(RELAXED in k[:2] for k in two)
    assert not any(RELAXED in k[:5] for k in five)
    assert any(RELAXED in k for k in two), "relaxation still happens after the first tokens"


# ---------------------------------------------------------------------------- no relaxed stops


def test_stop_positions_on_constructed_logits():
    V = 6
    logits = torch.full((2, 3, V), -5.0)
    logits[0, 0, 1], logits[0, 0, 2] = 4.0, 3.9  # top-1 1, top-2 2
    logits[0, 1, 5], logits[0, 1, 3] = 4.0, 3.9  # top-1 is the stop token 5
    logits[0, 2, 3], logits[0, 2, 4] = 4.0, 3.9
    logits[1] = logits[0]
    drafts = torch.tensor([[2, 3, 5], [2, 3, 4]])
    stops = torch.tensor([[5, -1], [5, 4]])
    got = stop_positions(drafts, logits, stops)
    assert got.tolist() == [[False, True, True], [False, True, True]]


STOP_CASES = [(r, t) for r in (Rule(MARS, 0.5), Rule(RATIO, rho=0.5), Rule(TOPK, top_n=2, delta=0.5),
                                Rule(TYPICAL, epsilon=0.05), Rule(REGRET, budget=5.0))
              for t in (0.0, 1.0) if mode_problem(r.name, t) is None]


@pytest.mark.parametrize("rule,temperature", STOP_CASES, ids=[f"{r.name}-{t:g}" for r, t in STOP_CASES])
def test_a_relaxed_rule_never_decides_where_an_output_ends(rule, temperature):
    """Constructed logits where each rule relaxes: a drafted stop token that is the target's
    runner-up, and a drafted runner-up where the target's top-1 is the stop token. The rule
    accepts both alone; with the stop positions guarded it accepts neither, and the greedy
    next token is the target's own (the stop token in the second case)."""
    V, EOS = 8, 7
    logits = torch.full((2, 2, V), -4.0)
    logits[0, 0, 1], logits[0, 0, EOS] = 4.0, 3.95  # draft EOS, the target's runner-up
    logits[1, 0, EOS], logits[1, 0, 2] = 4.0, 3.95  # draft 2 where the target would stop
    drafts = torch.tensor([[EOS], [2]])
    kw = {}
    if temperature:
        kw = dict(temperature=temperature, u_accept=torch.full((2, 1), 0.99), u_sample=torch.full((2,), 0.3))
    free = verify(drafts, logits, rule=rule, draft_len=torch.tensor([1, 1]), **kw)
    assert free.num_accepted.tolist() == [1, 1] and free.relaxed.all()
    stops = torch.tensor([[EOS], [EOS]])
    guard = stop_positions(drafts, logits[:, :1], stops)
    held = verify(drafts, logits, rule=rule, draft_len=torch.tensor([1, 1]), guard=guard, **kw)
    assert held.num_accepted.tolist() == [0, 0] and not held.relaxed.any()
    if not temperature:
        assert held.next_token.tolist() == [1, EOS]


def test_tree_verification_with_stop_positions():
    """The tree step guards nodes the same way (the node's judge is its parent's row)."""
    V, EOS = 8, 7
    logits = torch.full((3, V), -4.0)
    logits[0, 1], logits[0, EOS] = 4.0, 3.95  # root: top-1 1, runner-up EOS
    logits[1, EOS], logits[1, 2] = 4.0, 3.95  # after node 0: the target would stop
    logits[2, 3] = 4.0
    tree = DraftTree(torch.tensor([EOS, 2]), torch.tensor([-1, -1]))
    rule = Rule(MARS, 0.5)
    free = verify_tree(tree, logits, rule=rule)
    assert free.relaxed and free.relaxed[0]
    judge = logits[tree.parents + 1]
    guard = stop_positions(tree.tokens.view(1, 2), judge.unsqueeze(0), torch.tensor([[EOS]]))[0]
    held = verify_tree(tree, logits, rule=rule, guard=guard)
    assert not any(held.relaxed) and held.next_token == 1


def test_engine_never_relaxes_into_or_away_from_a_stop(target, draft):
    """Declare tokens the rule relaxed (without the stop rule) to be stop tokens: with
    strict stops none of them is ever emitted as a relaxed token, and the record does not end
    on a relaxation; without, the relaxed stop ends it."""
    rule = Rule(MARS, 0.3, "prob-ratio")
    items = [(p, SamplingParams(max_tokens=16, provenance=True)) for p in PROMPTS]
    engine = make_engine(target, draft, "mixed", rule, 1, wild_costs(0.04))
    base = [engine.generate_ids(target.tokenizer(p).input_ids, s) for p, s in items]
    relaxed_tokens = {res.token_ids[i] for res in base for i, kind in enumerate(res.provenance["kinds"])
                      if kind == RELAXED}
    assert relaxed_tokens
    eos = frozenset(target.eos_token_ids) | frozenset(relaxed_tokens)
    for strict_stops in (False, True):
        guard = dataclasses.replace(GUARD, strict_stops=strict_stops)
        engine = make_engine(target, draft, "mixed", rule, 1, wild_costs(0.04), guard)
        engine.settings = dataclasses.replace(engine.settings, eos=eos)
        outs = [engine.generate_ids(target.tokenizer(p).input_ids, s) for p, s in items]
        ended_on_relaxation = [o.provenance["kinds"][-1] == RELAXED and o.token_ids[-1] in eos for o in outs]
        if strict_stops:
            for o in outs:
                assert not any(k == RELAXED and t in eos for k, t in zip(o.provenance["kinds"], o.token_ids))
            assert not any(ended_on_relaxation)
        else:
            assert any(ended_on_relaxation), "without strict stops a relaxed draft ends a record"


def test_guard_off_is_the_papers_rule():
    assert GUARD_OFF.strict_first == 0 and not GUARD_OFF.strict_stops
    assert VerifyConfig("mars", 0.9).guard == GUARD_OFF
    g = GuardConfig()
    assert g.strict_first == 2 and g.strict_stops
    with pytest.raises(ValueError, match="--strict-first"):
        GuardConfig(strict_first=-1)
