"""Speed-aware calibration: the speed-up each candidate value of a rule's main knob (a
marscli.calibration.policies.RuleFamily: MARS's theta, ratio's rho, ...) is predicted to give, from the
collection run's replayed acceptance and the engine's measured step costs (marscli.engine.costs).

For a theta, replay says how many drafts every recorded step would have accepted
(``MarginData.replay``); the steps themselves (k_s drafts each) and their measured cost
t(B, k_s + 1) do not change, so

    speed-up over plain decoding = emitted(theta) / S_plain,   S_plain = sum_s t(B, k_s + 1) / t(B, 1)

(tokens per unit of a plain step's time), and the gain of the relaxed rule over strict
verification is emitted(theta) / emitted(strict) - 1. The prediction keeps the collection
run's draft lengths: a relaxed rule that is accepted more would also draft longer under the
cost-aware policy, so the gain is if anything understated. When that gain is under
MIN_RELAXED_GAIN the profile says so (``speed.verify_strictly``) and generate verifies
strictly by default: changing outputs for a few percent is a bad default.

``objective speed`` picks, among the thetas within the quality policy's budget (theta at or
above the policy's choice), the fastest; among thetas within SPEED_TIE of the fastest, the
least relaxed (largest theta).
"""

from __future__ import annotations

import math
from typing import Any

from marscli.verification.registry import STRICT, Rule

OBJECTIVE_QUALITY = "quality"
OBJECTIVE_SPEED = "speed"
OBJECTIVES = (OBJECTIVE_QUALITY, OBJECTIVE_SPEED)
#: The relaxed rule must be predicted at least this much faster than strict verification
#: for generate to use it by default.
MIN_RELAXED_GAIN = 0.03
#: Predicted speeds this close to the fastest count as equally fast.
SPEED_TIE = 0.005


def plain_step_units(data, costs, batch_size: int) -> float:
    """The collection run's steps in units of one plain step: sum_s t(B, k_s + 1) / t(B, 1)."""
    plain = costs.target(batch_size, 1)
    return float(sum(costs.step(batch_size, int(k)) for k in data.step_k)) / plain


def _replay(data, family, value: float):
    """The replay of ``family``'s rule at ``value`` (strict at +inf)."""

    return data.replay(Rule(STRICT) if value == math.inf else family.at(value))


def predicted_speedup(data, family, value: float, costs, batch_size: int = 1,
                      units: float | None = None) -> float:
    """Tokens per plain-step time had the run been verified by ``family`` (a RuleFamily) at
    ``value`` (1.0: as fast as plain)."""
    units = plain_step_units(data, costs, batch_size) if units is None else units
    if units <= 0:
        return 1.0
    return _replay(data, family, value).emitted / units


def speed_curve(data, family, values: list[float], costs, batch_size: int = 1) -> list[dict[str, float]]:
    """One row per knob value (and strict, +inf): its predicted speed-up over plain."""
    units = plain_step_units(data, costs, batch_size)
    rows = []
    for t in list(values) + [math.inf]:
        rows.append({family.knob: float(t),
                     "speedup": round(predicted_speedup(data, family, t, costs, batch_size, units), 4)})
    return rows


def fastest_within_budget(curve: list[dict[str, float]], budget_theta: float, family) -> float:
    """The fastest knob value at or beyond budget_theta towards strict (the quality policy's
    choice; theta: at or above it); among those within SPEED_TIE of it, the least relaxed."""
    key, direction = family.knob, family.direction
    toward = (lambda x: x >= budget_theta) if direction < 0 else (lambda x: x <= budget_theta)
    allowed = [r for r in curve if toward(r[key]) and math.isfinite(r[key])]
    if not allowed:
        return budget_theta
    best = max(r["speedup"] for r in allowed)
    fast = [r[key] for r in allowed if r["speedup"] >= best * (1.0 - SPEED_TIE)]
    return max(fast) if direction < 0 else min(fast)


def speed_section(data, family, theta: float, objective: str, costs, batch_size: int,
                  thetas: list[float]) -> dict[str, Any]:
    """The profile's ``speed`` section for the chosen knob value."""
    curve = speed_curve(data, family, sorted(set(thetas) | {theta}), costs, batch_size)
    units = plain_step_units(data, costs, batch_size)
    strict = predicted_speedup(data, family, math.inf, costs, batch_size, units)
    relaxed = predicted_speedup(data, family, theta, costs, batch_size, units)
    gain = relaxed / strict - 1.0 if strict > 0 else 0.0
    return {
        "objective": objective,
        "batch_size": int(batch_size),
        "costs": str(costs.source),
        "speedup_strict": round(strict, 4),
        "speedup_mars": round(relaxed, 4),
        "relaxed_gain": round(gain, 4),
        "min_gain": MIN_RELAXED_GAIN,
        "verify_strictly": bool(gain < MIN_RELAXED_GAIN),
        "curve": curve,
    }


def strict_reason(speed: dict[str, Any]) -> str:
    """Why generate verifies strictly with this profile (for stderr)."""
    return (f"the relaxed rule is predicted only {speed['relaxed_gain']:+.1%} faster than strict "
            f"verification (under {speed['min_gain']:.0%}) at batch size {speed['batch_size']}")
