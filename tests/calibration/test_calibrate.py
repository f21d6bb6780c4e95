"""Calibration: the replay matches the verifier, the curve is monotone, each policy keeps its
promise, and calibrate -> profile -> generate works end to end on a tiny model."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from marscli.calibration.collect import MarginCollector
from marscli.calibration.policies import (
    RuleFamily,
    critical_values,
    curve_values,
    pick_knob,
    promise,
    rule_curve,
    rule_histogram,
    walk,
)
from marscli.calibration.report import histogram_text
from marscli.config import SamplingParams
from marscli.engine.sequence import StepObservation
from marscli.verification.chain import NO_PROPOSAL, sampled_draws, sampling_probs, verify
from marscli.verification.registry import STRICT, Rule
from tests.helpers import STEP_K as K
from tests.helpers import STEP_V as V
from tests.helpers import _step, synthetic
from tests.verify_helpers import mars_greedy, rule_from_theta, strict_greedy


def _steps(gen, n: int, scale: float = 3.0) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """n chain steps of one record: K drafts mixing the target's top-1, top-2 and other
    tokens, the target's logits (tests.helpers._step), and the drafter's proposal for the
    position after the drafts (judged on the logits' last row): the top-1 or top-2 mostly,
    another token or none (NO_PROPOSAL) sometimes."""
    out = []
    for _ in range(n):
        d, lg = _step(gen, scale)
        order = lg[0, K].argsort(descending=True)
        pick = int(torch.randint(0, 10, (1,), generator=gen))
        out.append((d, lg, NO_PROPOSAL if pick < 2 else int(order[0 if pick < 5 else 1 if pick < 9 else 3])))
    return out


def _verify(step, position: int, rule: Rule, sampling: SamplingParams):
    """``verify`` of one step by ``rule``, with its bonus proposal; sampled with the record's
    seed at the step's output position."""
    d, lg, bonus = step
    sampled = not sampling.greedy
    return verify(d, lg, rule=rule, temperature=sampling.temperature, bonus=torch.tensor([bonus]),
                  seeds=torch.tensor([sampling.seed]) if sampled else None,
                  positions=torch.tensor([position]) if sampled else None)


def _observe(collector, steps, sampling) -> list[int]:
    """A strict run over ``steps`` as the calibrating engine shows it to the collector (the
    strict verdict, the proposal after the drafts); returns each step's output position
    on the strict trajectory."""
    positions, at = [], 0
    for step in steps:
        res = _verify(step, at, Rule(STRICT), sampling)
        emitted = int(res.num_accepted[0]) + 1
        bonus = step[2]
        collector(StepObservation(step[0], step[1], res, sampling, emitted,
                                  next_proposal=None if bonus == NO_PROPOSAL else bonus))
        positions.append(at)
        at += emitted
    return positions


def _replay_equals_verifier(data, steps, positions, sampling, thetas, margin="logit-ratio") -> list:
    """For each theta: the replay's accepted drafts, relaxed tokens and emitted tokens are the
    verifier's on the same steps (theta = inf: strict). Returns the verifier's results at
    the first theta."""
    first = None
    for theta in thetas:
        rep = data.replay(theta, margin)
        want = [_verify(s, t, rule_from_theta(theta, margin), sampling) for s, t in zip(steps, positions)]
        first = want if first is None else first
        assert rep.num_accepted.tolist() == [int(r.num_accepted[0]) for r in want], theta
        assert rep.relaxed == sum(int(r.relaxed.sum()) for r in want), theta
        assert rep.emitted == sum(len(r.emitted(s[0], 0)) for r, s in zip(want, steps)), theta
        if math.isinf(theta):  # strict: the collection run itself
            assert rep.num_accepted.tolist() == data.step_n.tolist() and rep.relaxed == 0
            assert rep.emitted == data.tokens
    return first


@pytest.mark.parametrize("margin", ["logit-ratio", "prob-ratio"])
def test_greedy_replay_equals_mars_verifier(margin):
    gen = torch.Generator().manual_seed(0)
    steps = _steps(gen, 200)
    col = MarginCollector()
    greedy = SamplingParams()
    positions = _observe(col, steps, greedy)
    data = col.data(records=1)
    bonus = sum(b != NO_PROPOSAL for _, _, b in steps)
    assert data.steps == 200 and data.positions == 200 * K + bonus and int(data.step_bonus.sum()) == bonus
    want = _replay_equals_verifier(data, steps, positions, greedy,
                                   (0.0, -0.5, 0.3, 0.6, 0.8, 0.9, 0.95, 0.99, math.inf), margin)
    # The bonus position counts: relaxed there after every draft was kept.
    assert any(bool(r.relaxed[0, K]) for r in want)
    # Relaxing must change something on this data, or the comparison above proves little.
    assert data.replay(0.0, margin).tau > data.replay(math.inf, margin).tau


def test_sampling_replay_equals_mars_sampling_verifier():
    """Sampled: the collector's strict_ok is the verifier's own verdict, the proposal equals
    the position's draw (a function of the record's seed and the output position), and the
    replay of MARS equals the MARS sampling verifier at those positions."""
    gen = torch.Generator().manual_seed(1)
    sampling = SamplingParams(temperature=0.8, seed=7)
    col = MarginCollector()
    steps = _steps(gen, 200, scale=1.5)
    positions = _observe(col, steps, sampling)
    data = col.data(records=1)
    assert data.sampled
    # strict_ok, position by position: the proposal is the draw there
    ok = []
    for (d, lg, bonus), t in zip(steps, positions):
        draws = sampled_draws(sampling_probs(lg, 0.8), torch.tensor([sampling.seed]), torch.tensor([t]))[0]
        props = d[0].tolist() + ([] if bonus == NO_PROPOSAL else [bonus])
        ok += [float(x == int(draws[j])) for j, x in enumerate(props)]
    assert data.strict_ok.tolist() == ok
    assert 0 < sum(ok) < len(ok)
    want = _replay_equals_verifier(data, steps, positions, sampling, (0.0, 0.5, 0.8, 0.95, math.inf))
    assert sum(int(r.relaxed.sum()) for r in want) > 0


def test_collector_records_the_proposal_after_the_drafts():
    """A step judged at its drafts and at the proposal after them: one more position, its
    rank and strict verdict the target's; a step without that proposal has none."""
    logits = torch.zeros(1, 3, V)
    logits[0, :, 3], logits[0, :, 4] = 5.0, 4.9  # top-1 token 3, top-2 token 4
    drafts = torch.tensor([[3, 3]])
    col = MarginCollector()
    for nxt in (4, None, 3):
        res = verify(drafts, logits, bonus=torch.tensor([NO_PROPOSAL if nxt is None else nxt]))
        assert int(res.num_accepted[0]) == 2
        col(StepObservation(drafts, logits, res, SamplingParams(), 3, next_proposal=nxt))
    data = col.data(records=1)
    assert data.step_k.tolist() == [2, 2, 2] and data.step_bonus.tolist() == [1, 0, 1]
    assert data.positions == 8 and data.rank.tolist() == [1, 1, 2, 1, 1, 1, 1, 1]
    assert data.strict_ok.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]
    assert data.logp_draft[2] == pytest.approx(data.logp2[2])
    rep = data.replay(0.9)  # the top-2 after two kept drafts: relaxed, the step's last token
    assert rep.num_accepted.tolist() == [2, 2, 2] and rep.relaxed == 1 and rep.emitted == 9
    assert data.replay(math.inf).relaxed == 0


def test_collector_refuses_a_replay_that_disagrees():
    logits = torch.zeros(1, 3, V)
    logits[0, :, 3], logits[0, :, 4] = 5.0, 4.9  # top-1 token 3, top-2 token 4, ratio 0.98
    drafts = torch.tensor([[4, 3]])
    res = mars_greedy(drafts, logits, 0.9, "logit-ratio")  # relaxed: not what strict does
    assert int(res.num_accepted[0]) == 2 and int(strict_greedy(drafts, logits).num_accepted[0]) == 0
    with pytest.raises(RuntimeError, match="replay disagrees"):
        MarginCollector()(StepObservation(drafts, logits, res, SamplingParams(), 3))


# --------------------------------------------------------------------------- synthetic data


@pytest.mark.parametrize("margin", ["logit-ratio", "prob-ratio"])
def test_curve_is_monotone(margin):
    data = synthetic()
    family = RuleFamily.mars(margin)
    thetas = sorted(set(np.linspace(-0.1, 1.0, 60).round(4).tolist()) | set(curve_values(data, family)))
    rows = rule_curve(data, family, thetas)
    assert math.isinf(rows[-1]["theta"]) and rows[-1]["relaxable_share"] == 0 and rows[-1]["nll_increase"] == 0
    for a, b in zip(rows, rows[1:]):
        assert b["theta"] > a["theta"]
        assert b["relaxable_share"] <= a["relaxable_share"]  # fewer positions as theta rises
        assert b["tau"] <= a["tau"]  # greedy data: relaxing only ever lengthens a step
    assert rows[0]["tau"] > rows[-1]["tau"]
    # The total log-probability given up only grows as theta falls. (Per token it need not: a
    # relaxed token can unlock a run of exact acceptances, adding tokens faster than cost.)
    reps = [data.replay(t, margin) for t in thetas]
    totals = [r.nll_increase * r.emitted for r in reps]
    relaxed = [r.relaxed for r in reps]
    assert all(x >= y - 1e-9 for x, y in zip(totals, totals[1:]))
    assert all(x >= y for x, y in zip(relaxed, relaxed[1:]))
    assert relaxed[0] > 0


@pytest.mark.parametrize("eps", [0.0, 0.005, 0.02, 0.1, 10.0])
def test_max_nll_increase_policy_keeps_its_promise(eps):
    data = synthetic()
    family = RuleFamily.mars("logit-ratio")
    theta = walk(data, family, promise("max-nll-increase", eps))
    assert data.replay(theta, "logit-ratio").nll_increase <= eps
    # ...and is the most relaxing such theta: one step further (the next lower statistic value
    # among positions where relaxing changes the outcome) breaks the budget.
    stat = data.logit_ratio
    lower = stat[(stat < theta) & (data.rank == 2)]
    if len(lower):
        assert data.replay(float(lower.max()), "logit-ratio").nll_increase > eps
    else:
        assert eps >= data.replay(-1.0, "logit-ratio").nll_increase
    rounded = pick_knob(data, family, "max-nll-increase", eps)
    assert theta <= rounded <= theta + 1e-4
    assert data.replay(rounded, "logit-ratio").nll_increase <= eps


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.25, 0.5, 0.9, 1.0])
def test_relax_rate_policy_keeps_its_promise(rate):
    """MARS's --relax-rate is every rule's relax rate: the share of verified positions where
    it accepts a draft strict verification rejects (here: top-2 drafts above theta)."""
    data = synthetic()
    family = RuleFamily.mars("logit-ratio")
    theta = walk(data, family, promise("relax-rate", rate))
    got = data.replay(theta, "logit-ratio").relax_rate
    assert got <= rate
    most = data.replay(float(critical_values(data, family)[-1]), "logit-ratio").relax_rate
    assert most == pytest.approx(float((data.rank == 2).mean()))  # every top-2 draft, at the end
    assert got >= min(rate, most) - 1.0 / data.positions  # as close as the data allow (no ties here)
    rounded = pick_knob(data, family, "relax-rate", rate)
    assert data.replay(rounded, "logit-ratio").relax_rate <= rate


def test_fixed_policy_records_the_value():
    assert pick_knob(synthetic(), RuleFamily.mars("logit-ratio"), "fixed", 0.9) == 0.9


def test_histogram_counts_every_position_by_rank():
    data = synthetic()
    data.logit_ratio[:7] = -math.inf  # z1 <= 0: never relaxable, counted below the range
    h = rule_histogram(data, Rule("mars", 0.9, "logit-ratio"))
    assert h["statistic"] == "logit-ratio"
    assert len(h["edges"]) == len(h["counts"]["rank1"]) + 1
    total = sum(sum(h["counts"][k]) + h["below"][k] for k in ("rank1", "rank2", "other"))
    assert total == data.positions
    assert sum(h["below"].values()) == 7
    assert sum(h["counts"]["rank2"]) + h["below"]["rank2"] == int((data.rank == 2).sum())
    text = histogram_text(h, theta=0.9)
    assert "<- theta" in text and "below 0" in text


# --------------------------------------------------------------------------- CLI, end to end


def test_calibrate_writes_a_profile_generate_picks_up(runner, tiny_model_dir, calib_prompts, tmp_path):
    from marscli.calibration.profiles import load_profile, user_profile_dir
    from marscli.cli import app

    plot = tmp_path / "c.png"
    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                            "--relax-rate", "0.3", "--plot", str(plot)])
    assert r.exit_code == 0, r.stderr
    assert r.stdout == ""
    files = list(user_profile_dir().glob("*.yaml"))
    assert len(files) == 1
    prof = load_profile(files[0])
    d = prof.data
    assert d["policy"] == {"name": "relax-rate", "value": 0.3}
    assert d["calibration_data"]["records"] == 4 and d["calibration_data"]["positions"] > 0
    assert d["summary"]["relaxable_share"] <= 0.3
    assert d["summary"]["tau_strict"] == d["summary"]["measured_tau_strict"]
    assert d["target"]["fingerprint"].startswith("folder-v1:")
    assert "trade-off curve" in r.stderr and "<- theta" in r.stderr
    assert plot.stat().st_size > 1000

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "g", "prompt": "one two three one two", "max_tokens": 8}) + "\n")
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir)])
    assert g.exit_code == 0, g.stderr
    res = json.loads(g.stdout)
    if prof.speed is not None and prof.speed["verify_strictly"]:
        # The profile predicts relaxing does not pay here: generate says so and verifies strictly.
        assert res["spec"]["verify"] == "strict" and "verifying strictly" in g.stderr
        g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--verify", "mars"])
        res = json.loads(g.stdout)
    assert res["spec"]["verify"] == "mars" and res["spec"]["theta"] == prof.theta
    assert res["spec"]["profile"] == {"name": prof.name, "sha256": prof.sha256}
    assert "using profile" in g.stderr

    # Command line beats profile; --no-profile and another drafter find none.
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--verify", "strict"])
    assert json.loads(g.stdout)["spec"]["verify"] == "strict"
    assert json.loads(g.stdout)["spec"]["profile"]["name"] == prof.name
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--theta", "0.5"])
    assert json.loads(g.stdout)["spec"]["theta"] == 0.5
    for extra in (["--no-profile"], ["--draft", "none"]):
        g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), *extra])
        spec = json.loads(g.stdout)["spec"]
        assert spec["verify"] == "strict" and spec["profile"] is None, extra

    # By name, from another folder's point of view: --profile supplies the target too.
    g = runner.invoke(app, ["generate", str(src), "--profile", prof.name, "--no-timing"])
    assert g.exit_code == 0, g.stderr
    assert json.loads(g.stdout)["spec"]["profile"]["sha256"] == prof.sha256


def test_profile_for_another_dtype_is_not_picked(runner, tiny_model_dir, calib_prompts, tmp_path):
    from marscli.calibration.profiles import (
        load_profile,
        save_profile,
        user_profile_dir,
    )
    from marscli.cli import app

    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir), "--theta", "0.9"])
    assert r.exit_code == 0, r.stderr
    path = next(user_profile_dir().glob("*.yaml"))
    data = load_profile(path).data
    assert data["policy"] == {"name": "fixed", "value": 0.9} and data["verification"]["theta"] == 0.9
    data["target"]["dtype"] = "bfloat16"
    save_profile(data, path)
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "one two", "max_tokens": 4}) + "\n")
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir)])
    assert json.loads(g.stdout)["spec"]["profile"] is None
    assert "calibrated with dtype bfloat16 (loaded: float32): not used" in g.stderr


@pytest.mark.parametrize("args, fragment", [
    (["--theta", "0.9", "--relax-rate", "0.1"], "give one policy"),
    (["--draft", "none"], "calibrate needs a drafter"),
    (["--margin", "z-score"], "--margin must be"),
])
def test_calibrate_usage_errors(runner, args, fragment, calib_prompts):
    from marscli.cli import app

    r = runner.invoke(app, ["calibrate", str(calib_prompts), *args])
    assert r.exit_code == 2
    assert fragment in r.stderr


def test_calibrate_with_a_draft_model_and_sampling(runner, tiny_model_dir, tiny_draft_dir, calib_prompts, tmp_path):
    """The sampling path (draft probabilities q from a model drafter) and model-drafter matching."""
    from marscli.calibration.profiles import load_profile
    from marscli.cli import app

    out = tmp_path / "p.yaml"
    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir), "--draft",
                            str(tiny_draft_dir), "--fixed-k", "-k", "3", "--temperature", "0.8", "--seed", "3",
                            "-o", str(out),
                            "--max-nll-increase", "0.05", "--quiet"])
    assert r.exit_code == 0, r.stderr
    d = load_profile(out).data
    assert d["drafter"]["kind"] == "model" and d["drafter"]["model"]["fingerprint"].startswith("folder-v1:")
    assert d["drafter"]["ngram_max"] is None
    assert d["sampling"]["temperature"] == 0.8 and d["sampling"]["seed"] == 3
    assert d["summary"]["nll_increase"] <= 0.05
    assert d["summary"]["tau_strict"] == d["summary"]["measured_tau_strict"]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"prompt": "one two", "max_tokens": 4}) + "\n")
    # Not in a profile dir: found only when named; the draft model comes from the profile.
    g = runner.invoke(app, ["generate", str(src), "--target", str(tiny_model_dir), "--draft", str(tiny_draft_dir)])
    assert json.loads(g.stdout)["spec"]["profile"] is None
    g = runner.invoke(app, ["generate", str(src), "--profile", str(out)])
    assert g.exit_code == 0, g.stderr
    spec = json.loads(g.stdout)["spec"]
    assert spec["drafter"] == "model" and spec["profile"]["name"] == d["name"]


@pytest.mark.parametrize("extra", [[], ["--temperature", "0.8", "--seed", "3"]], ids=["greedy", "sampling"])
def test_batched_calibration_writes_the_same_profile(runner, tiny_model_dir, calib_prompts, tmp_path, extra):
    """Per-record collectors merged in input order: with draft lengths that do not follow
    the batch (--fixed-k) the batch size changes no count, and floats only by the last bits
    of batched float32 matmuls (the logits are not bit-equal). With adaptive lengths (they
    follow the batch's step costs) the steps may differ, the strict text may not: the same
    records and tokens."""
    from marscli.calibration.profiles import load_profile
    from marscli.cli import app

    with open(calib_prompts, "a") as f:
        f.write("{broken\n")  # a skipped record keeps its count
        f.write(json.dumps({"id": "short", "prompt": "x", "max_tokens": 5}) + "\n")
    data = {}
    for lengths in (["--fixed-k"], []):
        for bs in (1, 3):
            out = tmp_path / f"p{bs}{lengths}.yaml"
            r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                                    "--relax-rate", "0.3", "-o", str(out), "--quiet", "--batch-size", str(bs),
                                    *lengths, *extra])
            assert r.exit_code == 3, r.stderr  # profile written, one record failed
            d = load_profile(out).data
            for volatile in ("created_at", "seconds", "calibration_seconds", "environment"):
                d.pop(volatile, None)
            d.get("calibration_data", {}).pop("seconds", None)
            d["summary"].pop("measured_tokens_per_s")
            data[bs, bool(lengths)] = d
    assert data[1, True]["calibration_data"]["positions"] > 0
    assert data[3, True] == _approx(data[1, True])
    adaptive = [data[bs, False]["calibration_data"] for bs in (1, 3)]
    for c in adaptive:
        c.pop("steps"), c.pop("positions")
    assert adaptive[0] == adaptive[1]
    assert adaptive[0]["tokens"] == data[1, True]["calibration_data"]["tokens"]  # any schedule: one text


def _approx(x):
    """pytest.approx through nested dicts and lists, the rest exact. Floats to 1e-5 relative
    or 1e-7 absolute: nll_increase is a small difference of large sums of log-probabilities,
    so its relative error is larger than the logits'."""
    if isinstance(x, dict):
        return {k: _approx(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_approx(v) for v in x]
    if isinstance(x, float):
        return pytest.approx(x, rel=1e-5, abs=1e-7)
    return x


def test_a_calibration_with_strict_spans_records_them_and_generate_uses_them(runner, tiny_model_dir,
                                                                            calib_prompts, tmp_path):
    """calibrate --strict-regex: the positions in the span are strict in the collection's replay
    (nothing relaxed where every position after the first character is in it), the profile
    records the spans, and generate verifies in them by default; --strict-in none relaxes."""
    from marscli.calibration.profiles import load_profile
    from marscli.cli import app

    def calibrate(name, *extra):
        out = tmp_path / f"{name}.yaml"
        r = runner.invoke(app, ["calibrate", str(calib_prompts), "--target", str(tiny_model_dir),
                                "--relax-rate", "0.5", "--strict-first", "0", "--repeat-guard", "0",
                                "--name", name, "-o", str(out), *extra])
        assert r.exit_code == 0, r.stderr
        return load_profile(out)

    free = calibrate("free")
    spans = calibrate("spans", "--strict-regex", "(?s).")
    assert "spans" not in free.data["verification"] and not free.spans.active
    assert spans.data["verification"]["spans"] == {"strict_in": [], "strict_regex": "(?s)."}
    assert spans.spans.strict_regex == "(?s)." and spans.spans.strict_in == ()
    assert free.data["summary"]["relaxed_share"] > 0  # the tiny model relaxes without the span
    # Only an output's first position lies outside the span: relaxing there alone.
    relaxed = spans.data["summary"]["relaxed_share"] * spans.data["calibration_data"]["tokens"]
    assert relaxed <= spans.data["calibration_data"]["records"] + 1e-6
    assert spans.data["summary"]["relaxed_share"] < free.data["summary"]["relaxed_share"]

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "g", "prompt": "one two three one two", "max_tokens": 8}) + "\n")
    base = ["generate", str(src), "--profile", str(tmp_path / "spans.yaml"), "--verify", "mars", "--no-timing"]
    g = runner.invoke(app, base)
    assert g.exit_code == 0, g.stderr
    assert json.loads(g.stdout)["spec"]["spans"] == {"strict_in": [], "strict_regex": "(?s)."}
    assert "strict spans regex '(?s).'" in g.stderr
    g = runner.invoke(app, [*base, "--strict-in", "none"])
    assert g.exit_code == 0, g.stderr
    assert "spans" not in json.loads(g.stdout)["spec"]
    g = runner.invoke(app, [*base, "--strict-in", "code"])
    assert json.loads(g.stdout)["spec"]["spans"] == {"strict_in": ["code"], "strict_regex": None}


def test_a_profile_with_a_broken_span_names_the_key(tmp_path):
    from marscli.calibration.profile_schema import ProfileError
    from marscli.calibration.profiles import load_profile

    src = next(p for p in sorted((Path(__file__).resolve().parents[2] / "profiles").glob("*.yaml")))
    doc = yaml.safe_load(src.read_text())
    for spans, fragment in (({"strict_in": ["prose"], "strict_regex": None}, "verification.spans.strict_in"),
                            ({"strict_in": [], "strict_regex": "(oops"}, "verification.spans.strict_regex")):
        doc["verification"]["spans"] = spans
        bad = tmp_path / "bad.yaml"
        bad.write_text(yaml.safe_dump(doc))
        with pytest.raises(ProfileError, match=re.escape(fragment)):
            load_profile(bad)
