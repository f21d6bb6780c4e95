"""Speed-aware calibration: predicted speed-ups per theta, the speed objective, and generate
verifying strictly when relaxing is predicted not to pay."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from marscli.calibration.policies import RuleFamily
from marscli.calibration.speed import (
    MIN_RELAXED_GAIN,
    fastest_within_budget,
    plain_step_units,
    predicted_speedup,
    speed_curve,
    speed_section,
)
from marscli.engine.costs import StepCosts
from tests.helpers import synthetic

MARS_LR = RuleFamily.mars("logit-ratio")


def flat_costs() -> StepCosts:  # drafting is free: the speed-up is tau itself
    return StepCosts((1,), (1, 9), ((1.0, 1.0),), (0.0,))


def steep_costs() -> StepCosts:  # a forward over 5 tokens costs twice a plain one
    return StepCosts((1,), (1, 5), ((1.0, 2.0),), (0.0,))


def test_predicted_speedup_is_tau_over_step_cost():
    data = synthetic(k=4)
    strict = data.replay(math.inf, "logit-ratio")
    assert predicted_speedup(data, MARS_LR, math.inf, flat_costs()) == pytest.approx(strict.tau)
    # Every step verifies 4 drafts: 5 tokens, twice a plain step.
    assert plain_step_units(data, steep_costs(), 1) == pytest.approx(2.0 * data.steps)
    assert predicted_speedup(data, MARS_LR, math.inf, steep_costs()) == pytest.approx(strict.tau / 2)


def test_curve_is_faster_where_it_relaxes_more():
    data = synthetic(k=4)
    curve = speed_curve(data, MARS_LR, [0.6, 0.8, 0.95], flat_costs())
    speeds = [r["speedup"] for r in curve]
    assert curve[-1]["theta"] == math.inf
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > speeds[-1]


def test_fastest_within_budget_prefers_the_least_relaxed_of_equals():
    curve = [{"theta": 0.5, "speedup": 2.0}, {"theta": 0.7, "speedup": 1.9},
             {"theta": 0.8, "speedup": 1.899}, {"theta": 0.9, "speedup": 1.5},
             {"theta": math.inf, "speedup": 1.2}]
    assert fastest_within_budget(curve, 0.6, MARS_LR) == 0.8  # 0.5 is over budget; 0.8 ties 0.7
    assert fastest_within_budget(curve, 0.4, MARS_LR) == 0.5
    assert fastest_within_budget(curve, 0.95, MARS_LR) == 0.95  # nothing allowed: the policy's own


def test_section_says_when_relaxing_does_not_pay():
    data = synthetic(k=4)
    pays = speed_section(data, MARS_LR, 0.5, "speed", flat_costs(), 1, [0.5, 0.9])
    assert pays["relaxed_gain"] > MIN_RELAXED_GAIN and not pays["verify_strictly"]
    assert pays["speedup_mars"] > pays["speedup_strict"]
    # A theta above every statistic relaxes nothing: no gain, verify strictly.
    none = speed_section(data, MARS_LR, 1.5, "quality", flat_costs(), 1, [0.9])
    assert none["relaxed_gain"] == 0.0 and none["verify_strictly"]


def _calibrate(runner, app, src, target, out, *extra):
    r = runner.invoke(app, ["calibrate", str(src), "--target", str(target), "-o", str(out), "--quiet", *extra])
    assert r.exit_code == 0, r.stderr
    return r


def test_profile_records_speed_and_generate_follows_it(runner, tiny_model_dir, calib_prompts, tmp_path):
    import yaml

    from marscli.calibration.profiles import load_profile
    from marscli.cli import app

    out = tmp_path / "p.yaml"
    _calibrate(runner, app, calib_prompts, tiny_model_dir, out, "--relax-rate", "0.3", "--objective", "speed")
    prof = load_profile(out)
    speed = prof.data["speed"]
    assert speed["objective"] == "speed" and speed["batch_size"] == 1 and speed["costs"] == "static"
    assert speed["curve"][-1]["theta"] == math.inf
    assert speed["verify_strictly"] == (speed["relaxed_gain"] < MIN_RELAXED_GAIN)
    # The objective picks a theta within the relax-rate budget.
    assert prof.data["summary"]["relaxable_share"] <= 0.3

    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "g", "prompt": "one two three one two", "max_tokens": 8}) + "\n")
    for strictly in (True, False):
        doc = yaml.safe_load(out.read_text())
        doc["speed"]["verify_strictly"] = strictly
        doc["speed"]["relaxed_gain"] = 0.01 if strictly else 0.2
        p = tmp_path / f"s{strictly}.yaml"
        p.write_text(yaml.safe_dump(doc))
        g = runner.invoke(app, ["generate", str(src), "--profile", str(p)])
        assert g.exit_code == 0, g.stderr
        spec = json.loads(g.stdout)["spec"]
        assert spec["verify"] == ("strict" if strictly else "mars")
        assert ("verifying strictly" in g.stderr) == strictly
        if strictly:
            assert "+1.0%" in g.stderr
            # Asked for: MARS all the same.
            g = runner.invoke(app, ["generate", str(src), "--profile", str(p), "--verify", "mars"])
            assert json.loads(g.stdout)["spec"]["verify"] == "mars"


def test_profiles_without_speed_still_load(runner, tiny_model_dir, calib_prompts, tmp_path):
    import yaml

    from marscli.calibration.profiles import ProfileError, load_profile
    from marscli.cli import app

    out = tmp_path / "p.yaml"
    _calibrate(runner, app, calib_prompts, tiny_model_dir, out, "--relax-rate", "0.3")
    doc = yaml.safe_load(out.read_text())
    assert doc["speed"]["objective"] == "quality"
    del doc["speed"]
    out.write_text(yaml.safe_dump(doc))
    assert load_profile(out).speed is None
    doc["speed"] = {"objective": "fast"}
    out.write_text(yaml.safe_dump(doc))
    with pytest.raises(ProfileError, match="speed.objective"):
        load_profile(out)


def test_objective_must_be_known(runner, calib_prompts):
    from marscli.cli import app

    r = runner.invoke(app, ["calibrate", str(calib_prompts), "--objective", "fastest"])
    assert r.exit_code == 2 and "--objective" in r.stderr


def test_speed_units_follow_the_recorded_steps():
    data = synthetic(n_steps=10, k=2)
    data.step_k[:] = np.array([0] * 5 + [2] * 5)  # plain steps cost 1, 3-token steps 1.5
    costs = StepCosts((1,), (1, 3), ((1.0, 1.5),), (0.0,))
    assert plain_step_units(data, costs, 1) == pytest.approx(5 * 1.0 + 5 * 1.5)
