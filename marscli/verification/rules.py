"""The per-position judgement of every verification rule (the rulebook's core).

``Rule`` (a rule and its knobs), the facts it judges a verified draft position by
(``PositionFacts``: margin statistics, p(x), p1, rank, entropy, summed regret; built by
``top2``/``margin_statistic`` and ``draft_facts``), and ``Rule.decide``, elementwise, so the
verifier's walks (marscli.verification.chain, marscli.verification.tree) and calibration's numpy replay
(marscli.calibration.collect) call the very same function. The words are fixed in marscli.verification.chain's
docstring; everything here is re-exported from there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import torch

from marscli.verification.registry import (
    LOGIT_RATIO,
    MARGINS,
    MARS,
    PROB_RATIO,
    RATIO,
    REGRET,
    STRICT,
    TOPK,
    TYPICAL,
    ALL_KNOBS,
    RULEBOOK,
    RuleSpec,
    rule_spec,
)

#: Statistic value of positions that can never be relaxed (z1 <= 0 under logit-ratio).
NOT_RELAXABLE = -math.inf


# ----------------------------------------------------------------------------- rules


@dataclass(frozen=True)
class Rule:
    """A verification rule and its knobs. Notation: at a verified draft position, target
    logits z, target probabilities p (at the sampling temperature and filters; temperature 1
    when decoding greedily), p1 >= p2 the top two, x the draft token.

    strict: keep a draft only where the target agrees (greedy: its argmax; sampling: Leviathan
    et al.'s test u < min(1, p(x) / q(x))). Lossless. Modes: all.

    mars (Shi et al., arXiv 2601.15498, Algorithm 1 and the authors' sampling code): at a
    position whose margin statistic exceeds ``theta`` accept a draft that is the target's
    top-1 or top-2 token (with p > 0) outright; elsewhere strict. A rejection at such a
    position draws the next token from p itself. Modes: all.

    The four rules below relax per draft token: each has a condition ``relaxes_at`` on the
    position's facts; a draft is accepted when the strict check accepts it OR the condition
    holds (unless the loop guard or the budget forbids relaxing there). A rejection is always
    judged by the strict check, so the next token comes from the strict residual. With a
    deterministic drafter (one-hot q) the law of the token emitted at a position whose draft
    is x is therefore: x itself when the condition holds, else exactly p (the strict law).

    ratio (``rho`` = R in (0, 1]): relax where p(x) >= R * p1, x at any rank with p(x) > 0.
    R = 1 is strict. When sampling, any R < 1 accepts a draft that is the target's top-1
    outright (strict rejection sampling keeps it with probability p1 only), so the family
    is strict only at R = 1 itself; topk with D > 0 likewise. (Speculative cascades' deferral rule, Narasimhan et al. 2024, and the
    "relative probability" acceptance of several MLX engines.) Modes: all.

    topk (``top_n`` = N >= 1, ``delta`` = D >= 0): relax where x is among the target's N most
    likely tokens (rank = 1 + the number of tokens with a larger logit) and
    p(x) >= p1 - D (TensorRT-LLM's relaxed acceptance for DeepSeek MTP: candidate set of the
    top-N, probability within delta of the top-1). D = 0 (or N = 1) is strict. Modes: all.

    typical (``epsilon`` = E in (0, 1], ``alpha`` = A > 0; A defaults to sqrt(E)): relax where
    p(x) > min(E, A * exp(-H(p))), H the entropy of p in nats (Medusa's typical acceptance,
    Cai et al. 2024, Section 2.3.1, once vLLM's TypicalAcceptanceSampler). The first position
    that fails gets the target's token (greedy) or a draw whose law is p (sampling). With
    E = 1 and A = +inf the threshold is 1 and nothing relaxes: strict. Modes: all.

    regret (``budget`` = B >= 0; greedy only): accept the drafts of a step while the step's
    summed regret sum_i (z1_i - z(x_i)) over the drafts so far stays <= B (approximate
    speculative decoding's logit-gap budget; invariant to a constant shift of the logits).
    A tree sums along the root path. B = 0 is strict. Modes: greedy.
    """

    # The knobs of every rule, each at its rule's strict end (registry.ALL_KNOBS).
    name: str = STRICT
    theta: float = ALL_KNOBS["theta"].default
    margin: str = LOGIT_RATIO
    rho: float = ALL_KNOBS["rho"].default
    top_n: int = ALL_KNOBS["top_n"].default
    delta: float = ALL_KNOBS["delta"].default
    epsilon: float = ALL_KNOBS["epsilon"].default
    alpha: float | None = ALL_KNOBS["alpha"].default  # None: sqrt(epsilon)
    budget: float = ALL_KNOBS["budget"].default

    def __post_init__(self) -> None:
        rule_spec(self.name)  # refuses an unknown name
        if self.margin not in MARGINS:
            raise ValueError(f"unknown margin statistic {self.margin!r}; expected one of {MARGINS}")
        for knob in ALL_KNOBS.values():  # every rule's knobs: a Rule carries all of them
            value = getattr(self, knob.name)
            if value is None and knob.name == "alpha":
                continue
            problem = knob.problem(value)
            if problem is not None:
                raise ValueError(problem)
        if self.alpha is None:
            object.__setattr__(self, "alpha", math.sqrt(self.epsilon))

    @classmethod
    def from_theta(cls, theta: float, margin: str = LOGIT_RATIO) -> Rule:
        """MARS at theta, or strict for theta = +inf (the older keyword interface)."""
        return cls(STRICT if theta == math.inf else MARS, theta, margin)

    @property
    def relaxes(self) -> bool:
        """Whether any position can be relaxed (never: strict, or a rule at its strict end)."""
        if self.name == MARS:
            return self.theta != math.inf
        if self.name == RATIO:
            return self.rho < 1.0
        if self.name == TOPK:
            return self.delta > 0.0 and self.top_n > 1
        if self.name == TYPICAL:
            return not (self.epsilon >= 1.0 and self.alpha == math.inf)
        if self.name == REGRET:
            return self.budget > 0.0
        return False

    @property
    def spec(self) -> RuleSpec:
        """The rule's registry entry (marscli.verification.registry)."""
        return RULEBOOK[self.name]

    @property
    def modes(self) -> tuple[str, ...]:
        """The decoding modes this rule defines (the jobs layer refuses the others)."""
        return self.spec.modes

    @property
    def knob(self) -> tuple[str, float] | None:
        """(name, value) of the main knob (the one calibrate fits); None for strict."""
        main = self.spec.main
        return None if main is None else (main, float(getattr(self, main)))

    def with_knob(self, value: float) -> Rule:
        """This rule with its main knob set to ``value``."""
        return replace(self, **{self.spec.main: value})

    @property
    def needs(self) -> frozenset[str]:
        """The PositionFacts fields beyond strict_ok (and guarded) that ``decide`` reads."""
        return self.spec.needs

    def knobs(self) -> dict[str, Any]:
        """The rule's knobs as written in profiles, results' spec and reports (MARS: theta,
        then its margin statistic)."""
        out: dict[str, Any] = {k: getattr(self, k) for k in self.spec.knob_names}
        if self.spec.uses_margin:
            out["margin"] = self.margin
        return out

    def label(self) -> str:
        """Short name: strict, mars@0.9, ratio@0.5, topk@3:0.1, typical@0.09:0.3, regret@2."""
        if not self.spec.knobs:
            return self.name
        return f"{self.name}@" + ":".join(f"{getattr(self, k):g}" for k in self.spec.knob_names)

    def relaxable(self, stat: Any) -> Any:
        """MARS, elementwise: the statistic exceeds theta (all False for a rule that never
        relaxes this way: every rule but MARS).

        Compared in float64: a float32 statistic against theta in float32 would round theta
        (0.3 -> 0.30000001) and call a statistic of 0.30000001 not above 0.3; calibration's
        replay, in float64, would disagree with the verifier."""
        if isinstance(stat, torch.Tensor):
            stat = stat.double()
        return stat > (self.theta if self.relaxes and self.name == MARS else math.inf)

    def relaxes_at(self, facts: PositionFacts) -> Any:
        """Elementwise bool: the per-token rules' condition (ratio, topk, typical, regret),
        before the guard. Compared in float64 (see ``relaxable``)."""
        f = _float64
        if self.name == RATIO:
            px = f(facts.p_draft)
            return (px >= self.rho * f(facts.p1)) & (px > 0)
        if self.name == TOPK:
            px = f(facts.p_draft)
            return (facts.rank <= self.top_n) & (px >= f(facts.p1) - self.delta) & (px > 0)
        if self.name == TYPICAL:
            px, h = f(facts.p_draft), f(facts.entropy)
            lib = torch if isinstance(h, torch.Tensor) else _np()
            threshold = lib.minimum(lib.exp(-h) * self.alpha, lib.full_like(h, self.epsilon)) \
                if self.alpha != math.inf else lib.full_like(h, self.epsilon)
            return px > threshold
        if self.name == REGRET:
            return f(facts.regret) <= self.budget
        raise ValueError(f"rule {self.name!r} has no per-token condition")

    def statistic(self, facts: PositionFacts) -> Any:
        """The number each position is judged by, for reports and provenance: MARS its
        margin statistic; ratio p(x)/p1; topk p1 - p(x); typical p(x); regret the summed
        regret so far; strict the margin statistic if known, else nothing."""
        if self.name == RATIO:
            return facts.p_draft / facts.p1
        if self.name == TOPK:
            return facts.p1 - facts.p_draft
        if self.name == TYPICAL:
            return facts.p_draft
        if self.name == REGRET:
            return facts.regret
        return facts.statistics.get(self.margin)

    def decide(self, facts: PositionFacts) -> Decision:
        """Judge every position on its own (the caller keeps the accepted prefix or path).
        A ``guarded`` position (the loop guard or the relaxation budget) is judged strictly."""
        if not self.relaxes:  # no margin needed: all False, of the facts' own type and shape
            return Decision(ok=facts.strict_ok, relaxable=facts.strict_ok & ~facts.strict_ok)
        if self.name == MARS:
            relaxable = self.relaxable(facts.statistics[self.margin])
            if facts.guarded is not None:
                relaxable = relaxable & ~facts.guarded
            ok = (relaxable & facts.in_top2) | (~relaxable & facts.strict_ok)
            return Decision(ok=ok, relaxable=relaxable)
        relaxable = self.relaxes_at(facts)
        if facts.guarded is not None:
            relaxable = relaxable & ~facts.guarded
        return Decision(ok=facts.strict_ok | relaxable, relaxable=relaxable)


def _float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) else x.astype("float64")


def _np():
    import numpy

    return numpy


@dataclass
class PositionFacts:
    """What the target says at verified draft positions, as elementwise arrays of one shape:
    torch tensors in the verifier, numpy arrays in calibration's replay. A rule reads only
    the fields of its ``Rule.needs``; the others may stay None."""

    statistics: Mapping[str, Any]  # margin name -> statistic (MARS: at least its margin)
    in_top2: Any  # bool: the draft is the target's top-1 or top-2 token and p(draft) > 0
    strict_ok: Any  # bool: the strict check accepts the draft there on its own
    #: bool or None: never relax here (the loop guard: the draft would extend a repeated
    #: n-gram of the recent output; or the record's relaxation budget is spent)
    guarded: Any = None
    p_draft: Any = None  # p(x): the target's probability of the draft token
    p1: Any = None  # the target's top probability
    rank: Any = None  # long: 1 + the number of tokens with a larger logit than the draft's
    entropy: Any = None  # H(p) in nats
    #: The step's summed regret z1 - z(x) over the drafts up to and including this one
    #: (a tree: along the root path); +inf past a draft of p(x) = 0.
    regret: Any = None


@dataclass
class Decision:
    ok: Any  # bool: the rule accepts the draft at this position (judged on its own)
    relaxable: Any  # bool: the check was relaxed here (a rejection draws from p, not a residual)


def over_budget(wants: Any, relax_left: Any) -> Any:
    """Elementwise [..., K]: the record's relaxation budget is spent by the time position i
    is reached: at least ``relax_left`` [...] would-be relaxations (``wants``: accepted only
    if relaxed) lie ahead of it in its step. Such a position is judged strictly. Torch
    tensors in the verifier, numpy arrays in calibration's replay."""
    w = wants.long() if isinstance(wants, torch.Tensor) else wants.astype("int64")
    ahead = w.cumsum(-1) - w
    return ahead >= relax_left[..., None]


def relaxed_positions(accepted: Any, relaxable: Any, strict_ok: Any) -> Any:
    """Elementwise: accepted only because the rule relaxed the check."""
    return accepted & relaxable & ~strict_ok


# ----------------------------------------------------------------------------- margins


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 and top-2 logits and token ids along the last dim.

    Ties resolve to the lowest token id, as torch.argmax (and so transformers' greedy
    search) does: top-1 is argmax; top-2 is argmax with the top-1 entry removed.
    Returns (z1, z2, t1, t2), each shaped like ``logits[..., 0]``.
    """
    x = logits.float()
    t1 = x.argmax(dim=-1)
    z1 = x.gather(-1, t1.unsqueeze(-1)).squeeze(-1)
    masked = x.scatter(-1, t1.unsqueeze(-1), -math.inf)
    t2 = masked.argmax(dim=-1)
    z2 = masked.gather(-1, t2.unsqueeze(-1)).squeeze(-1)
    return z1, z2, t1, t2


def margin_statistic(z1: torch.Tensor, z2: torch.Tensor, margin: str) -> torch.Tensor:
    """The margin statistic from top-1/top-2 raw logits (higher = closer call).

    logit-ratio: z2 / z1 where z1 > 0, else NOT_RELAXABLE (the ratio has no meaning there).
    prob-ratio: exp(z2 - z1) in [0, 1]; 0 when z2 = -inf.
    """
    z1 = z1.float()
    z2 = z2.float()
    if margin == LOGIT_RATIO:
        ratio = z2 / torch.where(z1 > 0, z1, torch.ones_like(z1))
        stat = torch.where(z1 > 0, ratio, torch.full_like(z1, NOT_RELAXABLE))
    elif margin == PROB_RATIO:
        stat = torch.exp(z2 - z1)
        stat = torch.where(torch.isfinite(z1), stat, torch.zeros_like(stat))
    else:
        raise ValueError(f"unknown margin statistic {margin!r}; expected one of {MARGINS}")
    return torch.nan_to_num(stat, nan=NOT_RELAXABLE, neginf=NOT_RELAXABLE)


# ----------------------------------------------------------------------------- token facts


def draft_facts(
    logits: torch.Tensor,  # [..., V] raw target logits at the rows that judge the drafts
    drafts: torch.Tensor,  # [...] long
    probs: torch.Tensor,  # [..., V] target probabilities there (sampling law; T = 1 if greedy)
    needs: frozenset[str],
) -> dict[str, torch.Tensor]:
    """The per-token facts a rule ``needs`` (PositionFacts fields), each shaped like
    ``drafts``: p_draft, p1, rank, entropy, and ``regret`` as each draft's own regret
    z1 - z(x) (the walk sums it over the step or the path)."""
    out: dict[str, torch.Tensor] = {}
    idx = drafts.unsqueeze(-1)
    if needs & {"p_draft", "p1"}:
        out["p_draft"] = probs.gather(-1, idx).squeeze(-1)
        out["p1"] = probs.max(dim=-1).values
    if "rank" in needs:
        z = logits.float()
        zx = z.gather(-1, idx)
        out["rank"] = 1 + (z > zx).sum(dim=-1)
    if "entropy" in needs:
        logp = torch.log(probs.double().clamp(min=1e-300))
        out["entropy"] = -(probs.double() * torch.where(probs > 0, logp, torch.zeros_like(logp))).sum(-1)
    if "regret" in needs:
        z = logits.float()
        out["regret"] = (z.max(dim=-1).values - z.gather(-1, idx).squeeze(-1)).double()
    return out
