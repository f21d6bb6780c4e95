"""The loop guard (issue 17): the repetition statistic, the guard's n-gram index, the guarded
and budgeted verifier against hand-made logits and against a plain no-cache reference loop,
calibration's replay with the guard, and a constructed loop that must not look cheap."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from marscli.calibration.collect import MarginCollector, MarginData
from marscli.config import (
    GUARD_OFF,
    DraftConfig,
    GuardConfig,
    SamplingParams,
    VerifyConfig,
)
from marscli.drafters.base import RowDrafters
from marscli.engine import build_engine
from marscli.engine.scheduler import Engine
from marscli.engine.sequence import StepObservation
from marscli.verification.chain import verify
from marscli.verification.guard import (
    NgramIndex,
    ends_in_loop,
    loop_period,
    repeat_flags,
    repeat_share,
)
from marscli.verification.registry import MARS, Rule
from marscli.verification.rules import margin_statistic, top2
from marscli.verification.tree import verify_tree
from tests.engines import RunnerUpDrafter
from tests.oracles import hf_greedy, position_loop

# --------------------------------------------------------------------------- the statistic


def test_repeat_flags_mark_tokens_that_complete_a_seen_ngram():
    #        a  b  c  d  a  b  c  e  a  b
    toks = [1, 2, 3, 4, 1, 2, 3, 5, 1, 2]
    assert repeat_flags(toks, n=3, window=100) == [False] * 6 + [True, False, False, False]
    assert repeat_flags(toks, n=2, window=100) == [False] * 5 + [True, True, False, False, True]
    # The window: "1 2" last seen 4 tokens before; a window of 3 tokens no longer holds it.
    assert repeat_flags(toks, n=2, window=3)[-1] is False
    assert repeat_share([], n=3) == 0.0
    assert repeat_share(toks, n=3, window=100) == pytest.approx(1 / 10)


def test_ends_in_loop_finds_periodic_tails_only():
    loop = [7, 8, 9] + [4, 5, 6, 5, 2] * 6  # period 5, 30 tokens of it
    assert loop_period(loop) == 5 and ends_in_loop(loop)
    assert not ends_in_loop(loop + [1])  # broken at the very end
    assert not ends_in_loop(list(range(100)))
    assert not ends_in_loop([3] * 10)  # too short to call a loop
    assert ends_in_loop([3] * 30)


def test_a_rewind_takes_back_every_relaxation_in_the_window_and_the_record_relaxes_no_more():
    """A record's loop rewinds (Sequence.commit): a loop within the window after relaxed
    tokens goes back to the earliest of them (one rewind for all the relaxations that could
    have started it), and after MAX_REWINDS (one) the record relaxes no more; a later loop
    can still take back a relaxation made before the rewound position."""
    from marscli.engine.sequence import RowSettings, Sequence
    from marscli.verification.guard import MAX_REWINDS

    assert MAX_REWINDS == 1  # the walk below is written for one
    guard = GuardConfig(0, 64, 1.0, 0, False, loop_rewind=64)
    settings = RowSettings(None, frozenset(), 8, None, guard=guard, relaxing=True, loop_rewind=64)
    seq = Sequence(settings, [1, 2, 3], SamplingParams(max_tokens=400))
    text = list(range(100, 200))  # 100 distinct tokens, relaxed at 5, 10, 60, 70 and 80
    seq.commit(text, 0, 0, [i in (5, 10, 60, 70, 80) for i in range(100)], 0)
    loop = [900, 901, 902, 903, 904] * 4

    def loop_from_here():
        base = len(seq.out)
        seq.commit(list(range(500 + base, 510 + base)) + loop, 0, 0, [], 0)

    assert seq.relax_left() is None
    loop_from_here()  # onset 110: 60, 70 and 80 lie within 64 of it, 5 and 10 do not; to 60
    assert (len(seq.out), seq.stats.rewinds, seq.relaxed_at) == (60, 1, [5, 10])
    assert seq.relax_left() == 0 and seq.strict_at == {60}
    assert seq.stats.relaxed == 2  # the three taken back are gone from the count
    loop_from_here()  # onset 70: 10 lies within 64 of it (5 does not); it goes
    assert (len(seq.out), seq.stats.rewinds, seq.relaxed_at) == (10, 2, [5])
    assert seq.strict_at == {60, 10}
    loop_from_here()  # onset 20: 5 is in the window too
    assert (len(seq.out), seq.stats.rewinds, seq.relaxed_at) == (5, 3, [])
    loop_from_here()  # nothing relaxed is left: the loop stays
    assert seq.stats.rewinds == 3 and ends_in_loop(seq.out)
    # each loop is caught at its 16th token (the test's shortest span), 10 tokens after the text
    assert seq.stats.rewound_tokens == (126 - 60) + (86 - 10) + (36 - 5)


def test_ngram_index_judges_drafts_against_the_output_and_the_drafts_ahead():
    idx = NgramIndex(n=3, window=50)
    idx.extend([10, 11, 12, 13])
    # 11 12 -> 13 seen; 12 13 -> 10 not; then (13, 10, 11) not; (10, 11, 12) seen in output
    assert idx.repeats([10, 11, 12]) == [False, False, True]
    # Inside the drafts: 5 6 7 5 6 7 repeats its own first trigram at its last token.
    assert idx.repeats([5, 6, 7, 5, 6, 7]) == [False] * 5 + [True]
    assert idx.tokens == [10, 11, 12, 13]  # asking changes nothing
    short = NgramIndex(n=3, window=50)
    assert short.repeats([1, 1, 1, 1]) == [False, False, False, True]  # overlapping counts
    with pytest.raises(ValueError):
        NgramIndex(n=1)


# --------------------------------------------------------------------------- the rulebook

V = 10


def _logits(rows: list[tuple[int, int, float]]) -> torch.Tensor:
    """[1, len(rows), V]: per row (top-1 token, top-2 token, z2/z1 ratio), z1 = 10."""
    lg = torch.full((1, len(rows), V), -5.0)
    for i, (t1, t2, r) in enumerate(rows):
        lg[0, i, t1] = 10.0
        lg[0, i, t2] = 10.0 * r
    return lg


def test_guarded_position_is_judged_strictly():
    logits = _logits([(1, 2, 0.95), (3, 4, 0.95), (5, 6, 0.5)])
    drafts = torch.tensor([[2, 4]])  # both the top-2 at relaxable positions
    rule = Rule(MARS, 0.9)
    free = verify(drafts, logits, rule=rule)
    assert int(free.num_accepted[0]) == 2 and free.relaxed[0].tolist() == [True, True, False]
    g = verify(drafts, logits, rule=rule, guard=torch.tensor([[False, True]]))
    assert int(g.num_accepted[0]) == 1 and int(g.next_token[0]) == 3  # the target's own token
    assert bool(g.refused[0]) and g.relaxable[0].tolist() == [True, False, False]
    # A guard on a position the strict check accepts changes nothing.
    top1 = verify(torch.tensor([[1, 3]]), logits, rule=rule, guard=torch.tensor([[True, True]]))
    assert int(top1.num_accepted[0]) == 2 and not bool(top1.refused[0])
    # Strict never relaxes: the guard is no business of it.
    s = verify(drafts, logits, rule=Rule(), guard=torch.tensor([[True, True]]))
    assert int(s.num_accepted[0]) == 0 and s.refused is None


@pytest.mark.parametrize("left,n,refused", [(0, 0, True), (1, 1, True), (2, 2, False), (5, 2, False)])
def test_budget_allows_exactly_the_relaxations_left(left, n, refused):
    logits = _logits([(1, 2, 0.95), (3, 4, 0.95), (5, 6, 0.95)])
    res = verify(torch.tensor([[2, 4]]), logits, rule=Rule(MARS, 0.9), relax_left=torch.tensor([left]))
    assert int(res.num_accepted[0]) == n and int(res.relaxed.sum()) == n
    assert bool(res.refused[0]) == refused


def test_budget_counts_only_relaxations_not_strict_acceptances():
    logits = _logits([(1, 2, 0.95), (3, 4, 0.95), (5, 6, 0.95), (7, 8, 0.5)])
    # top-1, top-2 (relaxed), top-1: one relaxation in all
    res = verify(torch.tensor([[1, 4, 5]]), logits, rule=Rule(MARS, 0.9), relax_left=torch.tensor([1]))
    assert int(res.num_accepted[0]) == 3 and int(res.next_token[0]) == 7


def test_sampling_guarded_position_emits_the_draw():
    """A guarded position is strict in sampling too: its token is the position's draw, as
    strict sampling's is, whatever was proposed there."""
    logits = _logits([(1, 2, 0.99), (3, 4, 0.5)])
    drafts = torch.tensor([[2]])
    hits = 0
    for s in range(200):
        kw = dict(temperature=1.0, seeds=torch.tensor([s]), positions=torch.tensor([0]))
        res = verify(drafts, logits, rule=Rule(MARS, 0.9), guard=torch.tensor([[True]]), **kw)
        strict = verify(drafts, logits, rule=Rule(), **kw)
        free = verify(drafts, logits, rule=Rule(MARS, 0.9), **kw)
        assert int(res.num_accepted[0]) == int(strict.num_accepted[0])
        assert int(res.next_token[0]) == int(strict.next_token[0])
        assert int(free.num_accepted[0]) == 1  # unguarded, the top-2 draft is kept
        hits += int(res.num_accepted[0])
    assert 0 < hits < 200  # the draw was the draft sometimes, another token other times


def test_tree_guard_and_budget_match_the_chain():
    """A tree that is one chain is verified as the chain is, with the guard and the budget."""
    from marscli.verification.tree import DraftTree

    logits = _logits([(1, 2, 0.95), (3, 4, 0.95), (5, 6, 0.95)])
    chain = torch.tensor([[2, 4]])
    tree = DraftTree(torch.tensor([2, 4]), torch.tensor([-1, 0]))
    rule = Rule(MARS, 0.9)
    for guard in ([False, False], [False, True], [True, False]):
        for left in (None, 0, 1, 2):
            c = verify(chain, logits, rule=rule, guard=torch.tensor([guard]),
                       relax_left=None if left is None else torch.tensor([left]))
            t = verify_tree(tree, logits[0], rule=rule, guard=torch.tensor(guard), relax_left=left)
            assert len(t.path) == int(c.num_accepted[0]), (guard, left)
            assert t.next_token == int(c.next_token[0]), (guard, left)


# --------------------------------------------------------------------------- the engine


def reference_loop(model, ids, max_new, k, theta, margin, guard: GuardConfig,
                   eos: frozenset[int] = frozenset()) -> tuple[list[int], int]:
    """MARS greedy with the loop guard, the budget, the strict first tokens and the stop rule
    (GuardConfig), position by position (oracles.position_loop) on the runner-up drafter's
    proposal for each position. Every logit comes from a full forward pass over the text."""
    budget = guard.budget(max_new)
    index = NgramIndex(guard.repeat_ngram, guard.repeat_window) if guard.repeat_ngram else None
    drafter = RunnerUpDrafter(model, k)

    def judge(z, d, out, relaxed):
        z1, z2, t1, t2 = top2(z)
        stat = float(margin_statistic(z1, z2, margin))
        rep = index.repeats([d])[0] if index is not None else False
        first = len(out) < guard.strict_first  # the output's strict first tokens
        stops = guard.strict_stops and (d in eos or int(t1) in eos)  # never relax a stop
        if d == int(t1):
            return d, False
        if (d == int(t2) and stat > theta and not rep and not first and not stops
                and (budget is None or relaxed < budget)):
            return d, True
        return int(t1), False

    return position_loop(model, ids, max_new, drafter.proposal, judge, eos,
                         after=None if index is None else (lambda t: index.extend([t])))


PROMPTS = ["the quick brown fox jumps over the lazy dog",
           "one two three four five six seven eight nine ten one two three",
           "a margin aware rule"]


STOPS_GUARD = GuardConfig(0, 64, 1.0, 0, True, loop_rewind=0)


@pytest.mark.parametrize("guard", [GuardConfig(2, 64, 1.0, 0, False, loop_rewind=0),
                                   GuardConfig(0, 64, 0.1, 0, False, loop_rewind=0),
                                   GuardConfig(3, 32, 0.15, 0, False, loop_rewind=0),
                                   GuardConfig(0, 64, 1.0, 5, False, loop_rewind=0),
                                   STOPS_GUARD, GuardConfig(3, 32, 0.05, loop_rewind=0), GUARD_OFF],
                         ids=["ngram", "budget", "both", "first", "stops", "default", "off"])
def test_guarded_engine_equals_the_no_cache_reference(target, guard):
    theta, margin, k, max_new = 0.3, "prob-ratio", 3, 40
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=k, adaptive=False)
    eos = frozenset(int(t) for t in target.eos_token_ids)
    if guard == STOPS_GUARD:
        # Stop tokens the unguarded rule relaxes to, so that the stop rule has work to do.
        free = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, k)),
                      Rule(MARS, theta, margin), cfg, guard=GUARD_OFF)
        for text in PROMPTS:
            res = free.generate_ids(target.tokenizer(text).input_ids,
                                    SamplingParams(max_tokens=max_new, provenance=True))
            eos |= {t for t, kind in zip(res.token_ids, res.provenance["kinds"]) if kind == "r"}
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, k)),
                    Rule(MARS, theta, margin), cfg, guard=guard)
    engine.settings = dataclasses.replace(engine.settings, eos=eos)
    refused = spent = 0
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=max_new))
        ref, ref_relaxed = reference_loop(target.model, ids, max_new, k, theta, margin, guard, eos)
        assert res.token_ids == ref, text
        assert res.stats.relaxed == ref_relaxed
        if guard.budgeted:
            assert res.stats.relaxed <= guard.budget(max_new)
        refused += res.stats.guard_refused
        spent += res.stats.budget_spent_at is not None
    if guard is not GUARD_OFF:  # the guard must have had something to do here
        assert refused > 0
    if guard.budgeted:
        assert spent > 0


def test_budget_switches_the_record_to_strict_at_the_right_token(target, oracle):
    """After the budget is spent, the output is the target's own greedy continuation of what
    came before (transformers' generate() as the oracle)."""
    guard = GuardConfig(0, 64, 0.1, loop_rewind=0)  # 4 relaxations in 40 tokens, no n-gram guard
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 3)),
                    Rule(MARS, 0.3, "prob-ratio"), cfg, guard=guard)
    checked = 0
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        at = res.stats.budget_spent_at
        if at is None:
            continue
        assert res.stats.relaxed == 4
        head, tail = res.token_ids[:at], res.token_ids[at:]
        assert tail == hf_greedy(oracle, ids + head, len(tail)), text
        checked += 1
    assert checked > 0


def test_relaxed_tokens_never_complete_a_repeated_ngram(target):
    guard = GuardConfig(3, 64, 1.0, loop_rewind=0)
    cfg = DraftConfig(kind="model", model="x", num_draft_tokens=3, adaptive=False)
    engine = Engine(target, RowDrafters(lambda: RunnerUpDrafter(target.model, 3)),
                    Rule(MARS, 0.3, "prob-ratio"), cfg, guard=guard)
    for text in PROMPTS:
        ids = target.tokenizer(text).input_ids
        res = engine.generate_ids(ids, SamplingParams(max_tokens=40))
        flags = repeat_flags(res.token_ids, 3, 64)
        with torch.no_grad():
            logits = target.model(torch.tensor([ids + res.token_ids])).logits[0, len(ids) - 1: -1]
        top1 = logits.argmax(-1).tolist()
        for i, tok in enumerate(res.token_ids):
            if tok != top1[i]:  # a relaxed token
                assert not flags[i], (text, i)


def test_build_engine_takes_the_verify_configs_guard(target):
    mars = VerifyConfig("mars", 0.9, guard=GuardConfig(3, 64, 0.5))
    eng = build_engine(target, None, mars, DraftConfig(kind="ngram"))
    assert eng.guard == GuardConfig(3, 64, 0.5)
    assert build_engine(target, None, VerifyConfig("mars", 0.9), DraftConfig(kind="ngram")).guard == GUARD_OFF


# --------------------------------------------------------------------------- calibration


def test_replay_with_guard_and_budget_equals_the_guarded_verifier():
    gen = torch.Generator().manual_seed(3)
    K = 4
    col = MarginCollector()
    steps = []
    for _s in range(300):
        logits = torch.randn(1, K + 1, V, generator=gen) * 3 + 1
        order = logits[0, :K].argsort(dim=-1, descending=True)
        col_ix = torch.randint(0, 2, (K,), generator=gen)  # top-1 or top-2 drafts
        drafts = order[torch.arange(K), col_ix].unsqueeze(0)
        guard = torch.rand(1, K, generator=gen) < 0.3
        res = verify(drafts, logits, rule=Rule())
        col(StepObservation(drafts, logits, res, SamplingParams(max_tokens=100),
                            int(res.num_accepted[0]) + 1, guard=guard))
        steps.append((drafts, logits, guard))
    for share in (1.0, 0.05):
        g = GuardConfig(3, 64, share)
        data = col.data(records=1, guard=g)
        for theta in (0.0, 0.5, 0.9):
            rep = data.replay(theta, "logit-ratio")
            made, want = 0, []
            budget = g.budget(100)
            for d, lg, gd in steps:  # the verifier, step by step, with the record's budget
                left = None if budget is None else torch.tensor([max(budget - made, 0)])
                r = verify(d, lg, rule=Rule(MARS, theta), guard=gd, relax_left=left)
                want.append(int(r.num_accepted[0]))
                made += int(r.relaxed.sum())
            assert rep.num_accepted.tolist() == want, (share, theta)
            assert rep.relaxed == made
    off = col.data(records=1, guard=GUARD_OFF).replay(0.0, "logit-ratio")
    on = col.data(records=1, guard=GuardConfig(3, 64, 1.0)).replay(0.0, "logit-ratio")
    assert on.relaxed < off.relaxed  # the guard's verdicts were used


def _loop_data(loop: bool) -> MarginData:
    """Steps of one record whose every draft is the target's runner-up at a close call
    (ratio 0.95, regret log p1 - log p2 = 0.1 nats), the text around it either a tight loop
    (the target is sure of it: log p1 = -0.01) or varied (log p1 = -1.5). The guard's verdict
    at each draft is what NgramIndex says of the token stream."""
    tokens = ([5, 6, 7] * 40) if loop else list(range(100, 220))
    flags = repeat_flags(tokens, 3, 64)
    P = len(tokens)
    logp1 = np.full(P, -0.01 if loop else -1.5)
    return MarginData(
        step_k=np.ones(P, dtype=np.int64), step_n=np.zeros(P, dtype=np.int64), tokens=P, records=1,
        failed_records=0, logit_ratio=np.full(P, 0.95), prob_ratio=np.full(P, 0.9), z1=np.full(P, 10.0),
        rank=np.full(P, 2.0), logp1=logp1, logp2=logp1 - 0.1, logp_draft=logp1 - 0.1,
        strict_ok=np.zeros(P), guarded=np.asarray(flags, dtype=float),
        step_record=np.zeros(P, dtype=np.int64), record_max_tokens=np.asarray([P]),
        guard=GuardConfig(3, 64, 1.0))


def test_a_constructed_loop_does_not_look_cheap_to_calibration():
    """Looping text is likely text (here its NLL is 150x lower), but calibration's cost is the
    regret of each relaxed token, so it is the same per relaxed token for the loop as for
    varied text; and the guard refuses the relaxations that extend the loop."""
    loop, varied = _loop_data(True), _loop_data(False)
    assert -loop.logp1.mean() < -varied.logp1.mean() / 100  # the NLL proxy would prefer the loop
    rl_off = MarginData(**{**loop.__dict__, "guard": GUARD_OFF, "_grid": {}}).replay(0.9, "logit-ratio")
    rv = varied.replay(0.9, "logit-ratio")
    rl = loop.replay(0.9, "logit-ratio")
    # Unguarded, both relax every draft at the same cost per relaxed token.
    assert rl_off.relaxed == rv.relaxed == len(varied.rank)
    assert rl_off.nll_increase == pytest.approx(rv.nll_increase)
    # Guarded: only the first tokens of the loop, before it repeats, may be relaxed.
    assert rl.relaxed == 5  # 5 6 7 5 6: the first trigram to come back is (5, 6, 7) at token 5
    assert rl.nll_increase < rl_off.nll_increase
    assert math.isclose(rl.nll_increase * rl.emitted, 0.1 * rl.relaxed)


# --------------------------------------------------------------------------- CLI, profiles


def test_guard_travels_from_calibrate_to_profile_to_results(runner, tiny_model_dir, tmp_path):
    import json

    from marscli.calibration.profiles import load_profile, user_profile_dir
    from marscli.cli import app

    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"id": str(i), "prompt": p, "max_tokens": 24}) + "\n"
                           for i, p in enumerate(PROMPTS)))
    r = runner.invoke(app, ["calibrate", str(src), "--target", str(tiny_model_dir), "--relax-rate", "0.3",
                            "--repeat-guard", "3", "--repeat-window", "32", "--max-relaxed-share", "0.5",
                            "--strict-first", "1"])
    assert r.exit_code == 0, r.stderr
    prof = load_profile(next(user_profile_dir().glob("*.yaml")))
    assert prof.data["verification"]["guard"] == {"repeat_ngram": 3, "repeat_window": 32,
                                                  "max_relaxed_share": 0.5, "strict_first": 1,
                                                  "strict_stops": True, "loop_rewind": 64}
    assert prof.guard == GuardConfig(3, 32, 0.5, 1)

    # --verify mars: the profile's theta and guard, even where it predicts relaxing does not pay
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--no-timing",
                            "--verify", "mars"])
    assert g.exit_code == 0, g.stderr
    for line in g.stdout.splitlines():
        spec = json.loads(line)["spec"]
        assert spec["verify"] == "mars" and spec["guard"] == prof.data["verification"]["guard"]
        assert 0.0 <= spec["repeat_share"] <= 1.0 and isinstance(spec["ends_in_loop"], bool)
        assert spec["guard_refused"] >= 0 and "budget_spent_at" in spec
    # The command line beats the profile; --no-guard turns every guard off (the paper's rule
    # alone), but an explicit --strict-first still applies.
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--no-guard",
                            "--verify", "mars"])
    spec = json.loads(g.stdout.splitlines()[0])["spec"]
    assert spec["guard"] == {"repeat_ngram": 0, "repeat_window": 32, "max_relaxed_share": 1.0,
                             "strict_first": 0, "strict_stops": False, "loop_rewind": 0}
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--no-guard",
                            "--strict-first", "3", "--verify", "mars"])
    assert json.loads(g.stdout.splitlines()[0])["spec"]["guard"]["strict_first"] == 3
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--verify", "strict"])
    spec = json.loads(g.stdout.splitlines()[0])["spec"]
    assert "guard" not in spec and "guard_refused" not in spec and "repeat_share" in spec


@pytest.mark.parametrize("args,fragment", [
    (["--no-guard", "--repeat-guard", "3"], "--no-guard excludes"),
    (["--no-guard", "--loop-rewind", "8"], "--no-guard excludes"),
    (["--loop-rewind", "-1"], "--loop-rewind"),
    (["--repeat-guard", "1"], "--repeat-guard must be 0 (off) or at least 2"),
    (["--strict-first", "-1"], "--strict-first"),
    (["--repeat-guard", "8", "--repeat-window", "4"], "--repeat-window (4) must be at least"),
])
def test_guard_usage_errors(runner, tiny_model_dir, tmp_path, args, fragment):
    from marscli.cli import app

    src = tmp_path / "p.jsonl"
    src.write_text('{"prompt": "x"}\n')
    r = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--verify", "mars",
                                 *args])
    assert r.exit_code == 2 and fragment in r.stderr, r.stderr
    assert r.stdout == ""


def test_profiles_without_a_guard_still_load():
    from marscli.calibration.profiles import load_profile, packaged_profile_dir

    files = list(packaged_profile_dir().glob("*.yaml"))
    assert files
    for f in files:
        p = load_profile(f)
        assert p.guard is None or isinstance(p.guard, GuardConfig)
