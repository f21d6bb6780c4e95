"""Choosing a rule's main knob from a collection run: one policy vocabulary for every rule.

MARS's theta, ratio's rho, topk's delta, typical's epsilon and regret's budget are chosen the
same way, on the same recorded facts (one collection run serves every rule;
marscli.calibration.collect), by one of the policies of ``POLICIES``:

- ``max-nll-increase EPS``: the most relaxing knob whose estimated cost stays within EPS nats
  of target log-probability per emitted token (the cost of a relaxed token is its regret on
  the strict trajectory, log p1 - log p(draft));
- ``relax-rate S``: the most relaxing knob whose **relax rate** is at most S. The relax rate
  (``Replay.relax_rate``) is every rule's common measure of how much it relaxes: the share
  of verified draft positions at which the rule, judging the position on its own (with the
  loop guard and the relaxation budget as replayed), accepts a draft that strict
  verification rejects there;
- ``fixed V``: the knob V itself, recorded as such.

Each rule relaxes a position once its knob passes a **critical value** of that position
(computed from the facts: MARS its statistic, ratio p(x)/p1, topk p1 - p(x), typical
max(p(x), (p(x) e^H)^2) with alpha tied to sqrt(epsilon) or p(x) with alpha fixed, regret the
step's summed regret so far). The replay only changes at those values, so a policy walks them
from the knob's strict end towards more relaxing ones (``walk``) and keeps the last value whose
replay (``MarginData.replay``: the verifier's own rules.decide) keeps its promise; the critical
values only say where to look, every promise is checked on the replay itself. The chosen
value is then rounded towards the strict end to KNOB_DECIMALS where the promise still holds.

``match_relax_rate`` sets each rule's knob so that all relax the same share: bench's
``--match-relax-rate``. ``analyse`` gathers what a profile records: the chosen rule, the
summary figures, the histogram of the rule's statistic and the trade-off curve.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from marscli.calibration.collect import (
    RANK_OTHER,
    RANK_TOP1,
    RANK_TOP2,
    MarginData,
    Replay,
    significant,
)
from marscli.calibration.profile_schema import (
    POLICY_FIXED,
    POLICY_MAX_NLL,
    POLICY_RELAX_RATE,
    RANK_KEYS,
)
from marscli.verification.registry import (
    KNOBS,
    MARS,
    RATIO,
    REGRET,
    STRICT,
    TYPICAL,
    Rule,
    RuleSpec,
)
from marscli.verification.rules import BEHAVIOURS, statistic

#: Default policy parameter: at most 0.02 nats of target log-probability given up per token.
DEFAULT_MAX_NLL_INCREASE = 0.02
#: Chosen knobs are rounded towards the strict end to this many decimals when the policy's
#: promise still holds there: 0.9617 reads better than 0.9616848826408386 and is as good.
KNOB_DECIMALS = 4
#: Histogram bins (MARS's statistics, ratio, topk and typical live in [0, 1]; below 0 apart).
HIST_BINS = 200
_QUANTILES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)


@dataclass(frozen=True)
class RuleFamily:
    """A rule with its main knob free: ``at(value)`` is the rule at that value (its other
    knobs, and MARS's margin statistic, as in ``template``). typical's alpha follows
    sqrt(epsilon) when ``tie_alpha`` (no --alpha given), else stays fixed."""

    template: Rule
    tie_alpha: bool = False

    @classmethod
    def of(cls, rule: Rule, alpha_given: bool | None = None) -> RuleFamily:
        """``alpha_given`` None: a typical template whose alpha is sqrt(epsilon) is tied."""
        if rule.name not in KNOBS:
            raise ValueError(f"the {rule.name} rule has no knob to calibrate")
        if rule.name != TYPICAL:
            return cls(rule)
        tied = rule.alpha == math.sqrt(rule.epsilon) if alpha_given is None else not alpha_given
        return cls(rule, tied)

    @classmethod
    def mars(cls, margin: str) -> RuleFamily:
        """MARS's theta for the margin statistic ``margin``."""
        return cls(Rule(MARS, margin=margin))

    @property
    def name(self) -> str:
        return self.template.name

    @property
    def spec(self) -> RuleSpec:
        return self.template.spec

    @property
    def knob(self) -> str:
        return self.spec.main

    @property
    def direction(self) -> int:
        """+1 when larger values relax more, -1 when smaller ones do."""
        return self.spec.direction

    @property
    def strict_end(self) -> float:
        """The least relaxing value (strict itself, except typical: epsilon 1 still relaxes)."""
        return self.spec.strict_end

    def at(self, value: float) -> Rule:
        if self.tie_alpha:
            return replace(self.template, epsilon=float(value), alpha=None)
        return self.template.with_knob(float(value))


# --------------------------------------------------------------------------- critical values


def critical_values(data: MarginData, family: RuleFamily) -> np.ndarray:
    """Knob values to walk, from the strict end outwards, where the replay changes: each
    rule's own (rules.RuleBehaviour.critical_values; MARS: its sensitive statistic values,
    the other rules: one value per position where the rule can change the outcome, each the
    value that just lets that position relax), subsampled to rules.MAX_CANDIDATES."""
    rule = family.template
    return BEHAVIOURS[rule.name].critical_values(rule, data, family.tie_alpha)


def walk(data: MarginData, family: RuleFamily, keeps) -> float:
    """The most relaxing knob value reached from the strict end through the critical values
    while ``keeps(replay)`` holds at every one (the strict end when none does)."""
    best = family.strict_end
    for v in critical_values(data, family):
        if not keeps(data.replay(family.at(float(v)))):
            break
        best = float(v)
    return best


# --------------------------------------------------------------------------- policies


def relax_rate(data: MarginData, rule: Rule) -> float:
    """The rule's relax rate on these data (see the module docstring)."""
    return data.replay(rule).relax_rate


def promise(policy: str, value: float):
    """What a policy promises of a replay: max-nll-increase, its cost within ``value`` nats
    per token; relax-rate, its relax rate at most ``value``."""
    if policy == POLICY_MAX_NLL:
        return lambda r: r.nll_increase <= value
    if policy == POLICY_RELAX_RATE:
        return lambda r: r.relax_rate <= value
    raise ValueError(f"unknown policy {policy!r}")


def pick_knob(data: MarginData, family: RuleFamily, policy: str, value: float) -> float:
    """The knob chosen by a policy (fixed: ``value`` itself; the others: the most relaxing
    knob that keeps the promise), rounded towards the strict end to KNOB_DECIMALS where the
    promise still holds."""
    if policy == POLICY_FIXED:
        return float(value)
    keeps = promise(policy, value)
    knob = walk(data, family, keeps)
    if knob == family.strict_end:
        return knob
    scale = 10 ** KNOB_DECIMALS
    rounded = (math.ceil(knob * scale) if family.direction < 0 else math.floor(knob * scale)) / scale
    if family.name in (RATIO, TYPICAL):
        rounded = min(rounded, 1.0)
    if rounded != family.strict_end and keeps(data.replay(family.at(rounded))):
        return rounded
    return knob


#: What match_relax_rate holds equal across rules. RELAX_RATE: the relax rate (each position
#: judged on its own). RELAXED: relaxed drafts the replay accepts per verified position (what
#: the rule actually does on the strict trajectory; bench --match-relax-rate matches this).
#: The two differ by rule: a relaxation judged on its own past a step's first rejection
#: counts in the relax rate but is never reached, and rules differ in how many such
#: positions they have (regret's summed budget has none: its relaxations are a prefix).
RELAX_RATE = "relax-rate"
RELAXED = "relaxed"


def relaxed_per_position(data: MarginData, replay: Replay) -> float:
    """Relaxed drafts the replay accepts per verified draft position."""
    return replay.relaxed / data.positions if data.positions else 0.0


def match_relax_rate(data: MarginData, rules: list[Rule], share: float,
                     by: str = RELAX_RATE) -> list[Rule]:
    """Each rule with its main knob set so that it relaxes at most a share ``share`` of the
    verified draft positions of ``data`` (``by``: RELAX_RATE, its relax rate, or RELAXED, the
    relaxed drafts its replay accepts), as close to it as the data allow: the fair setting to
    compare rules (bench --match-relax-rate). Strict stays strict; a typical rule whose alpha
    is sqrt(epsilon) keeps it tied. No rounding: the knobs are the exact values the walk
    found."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the relax rate must be in [0, 1], got {share}")
    if by not in (RELAX_RATE, RELAXED):
        raise ValueError(f"match by {RELAX_RATE!r} or {RELAXED!r}, not {by!r}")
    keeps = ((lambda r: r.relax_rate <= share) if by == RELAX_RATE
             else (lambda r: relaxed_per_position(data, r) <= share))
    out = []
    for rule in rules:
        if rule.name == STRICT:
            out.append(rule)
            continue
        family = RuleFamily.of(rule)
        out.append(family.at(walk(data, family, keeps)))
    return out


# --------------------------------------------------------------------------- curve, histogram


def curve_values(data: MarginData, family: RuleFamily, extra: tuple[float, ...] = ()) -> list[float]:
    """A knob grid, most relaxing first: quantiles of where the data are (MARS: its finite
    statistic values; the other rules: their critical values), the knob's round values
    (registry.Knob.round_values) and ``extra`` (the chosen one), all inside the knob's range."""
    if family.name == MARS:
        stat = data.statistic(family.template.margin)
        where = stat[np.isfinite(stat)]
    else:
        where = critical_values(data, family)
    qs = [round(float(q), 4) for q in np.quantile(where, _QUANTILES)] if len(where) else []
    vals = set(qs) | set(family.spec.main_knob.round_values) | {float(x) for x in extra}
    ok = []
    for v in vals:
        try:
            if family.at(v).relaxes or family.name == TYPICAL:
                ok.append(v)
        except ValueError:  # out of the knob's range (e.g. a quantile of 0 for rho)
            continue
    return sorted(ok, reverse=family.direction > 0)


def strict_row(data: MarginData, family: RuleFamily) -> dict[str, float]:
    """Strict verification's curve row, its knob written +inf (as MARS's theta = +inf): the
    mark of the strict row in every rule's curve."""
    row = data.replay(Rule(STRICT)).row()
    del row["theta"]
    return {family.knob: math.inf, **row}


def rule_curve(data: MarginData, family: RuleFamily, values: list[float]) -> list[dict[str, float]]:
    """One row per knob value, and a last row for strict verification."""
    return [data.replay(family.at(v)).row() for v in values] + [strict_row(data, family)]


def rule_statistic(data: MarginData, rule: Rule) -> np.ndarray:
    """[P] the number each position is judged by (the verifier's rules.statistic on the facts)."""
    g = data.grid()
    return np.asarray(statistic(rule, data.facts(rule)))[g["valid"]]


def rule_histogram(data: MarginData, rule: Rule, bins: int = HIST_BINS) -> dict[str, Any]:
    """Counts of the rule's statistic by draft rank (MARS's margin statistic, ratio p(x)/p1,
    topk p1 - p(x), typical p(x) over [0, 1]; regret over [0, its 99th percentile]); values
    below 0 (and -inf) apart."""
    stat = rule_statistic(data, rule)
    hi = 1.0
    if rule.name == REGRET:
        finite = stat[np.isfinite(stat)]
        hi = max(1.0, float(np.ceil(np.quantile(finite, 0.99)))) if len(finite) else 1.0
    edges = np.linspace(0.0, hi, bins + 1)
    counts, below = {}, {}
    for key, sel in zip(RANK_KEYS, (data.rank == RANK_TOP1, data.rank == RANK_TOP2, data.rank == RANK_OTHER)):
        v = stat[sel]
        v = v[~np.isnan(v)]
        below[key] = int((v < 0).sum())
        c, _ = np.histogram(np.clip(v[v >= 0], 0.0, hi), bins=edges)
        counts[key] = [int(x) for x in c]
    return {"statistic": rule.spec.statistic or rule.margin, "edges": [round(float(e), 6) for e in edges],
            "below": below, "counts": counts}


# --------------------------------------------------------------------------- the result


@dataclass
class Calibration:
    """What calibrate decided and why: the figures a profile records."""

    policy: str
    policy_value: float
    theta: float  # the rule's main knob's chosen value (theta for MARS)
    summary: dict[str, float]
    histogram: dict[str, Any]
    curve: list[dict[str, float]]
    rule: Rule  # the rule chosen, at that value

    @property
    def margin(self) -> str:
        return self.rule.margin

    def chosen_rule(self) -> Rule:
        return self.rule


def summary_figures(data: MarginData, at: Replay, strict: Replay, seconds: float) -> dict[str, float]:
    """The profile's summary: the chosen rule's replay beside strict's (tau_mars holds the
    chosen rule's tau whatever the rule: the key is schema 1's) and the measured run."""
    measured_tau = data.tokens / data.steps if data.steps else 0.0
    return {
        "relaxable_share": significant(at.relaxable_share),
        "relaxed_share": significant(at.relaxed_share),
        "tau_strict": significant(strict.tau),
        "tau_mars": significant(at.tau),
        "nll_increase": significant(at.nll_increase),
        "measured_tau_strict": significant(measured_tau),
        "measured_tokens_per_s": significant(data.tokens / seconds if seconds > 0 else 0.0),
        "relax_rate": significant(at.relax_rate),
    }


def analyse(data: MarginData, family: RuleFamily, policy: str, value: float, seconds: float) -> Calibration:
    """Choose the family's knob by the policy and gather the profile's figures."""
    knob = pick_knob(data, family, policy, value)
    rule = family.at(knob)
    summary = summary_figures(data, data.replay(rule), data.replay(Rule(STRICT)), seconds)
    curve = rule_curve(data, family, curve_values(data, family, (knob,)))
    return Calibration(policy, float(value), knob, summary, rule_histogram(data, rule), curve, rule)
