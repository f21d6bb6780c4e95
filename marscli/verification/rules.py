"""The per-position judgement of every verification rule (the rulebook's core).

The facts a rule judges a verified draft position by (``PositionFacts``: margin statistics,
p(x), p1, rank, entropy, summed regret; built by ``top2``/``margin_statistic`` and
``draft_facts``), each rule's behaviour in one block (a ``RuleBehaviour`` registered under
its registry name: its condition with the formula and source, its statistic, its critical
values for calibration, whether the margin facts judge it and its margin check, MARS's
``relaxable``) and ``decide``, elementwise, so the verifier's walks
(marscli.verification.chain, marscli.verification.tree) and calibration's numpy replay
(marscli.calibration.collect) call the very same function. A rule's name and knobs (the
``Rule`` value) are the registry's (marscli.verification.registry); the words are fixed in
marscli.verification's docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
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
    Rule,
    rule_spec,
)

#: Statistic value of positions that can never be relaxed (z1 <= 0 under logit-ratio).
NOT_RELAXABLE = -math.inf
#: Critical values a calibration walk visits exactly (subsampled beyond).
MAX_CANDIDATES = 4096


# ----------------------------------------------------------------------------- the judgement
# Notation: at a verified draft position, target logits z, target probabilities p (at the
# sampling temperature and filters; temperature 1 when decoding greedily), p1 >= p2 the top
# two, x the draft token. Every function is elementwise over arrays of one shape: torch
# tensors in the verifier, numpy arrays in calibration's replay. Comparisons are made in
# float64: a float32 statistic against theta in float32 would round theta (0.3 ->
# 0.30000001) and call a statistic of 0.30000001 not above 0.3; calibration's replay, in
# float64, would disagree with the verifier.


def relaxable(rule: Rule, stat: Any) -> Any:
    """The rule's margin check (``RuleBehaviour.relaxable``): MARS's (``Mars``) relaxes the
    position where its margin statistic exceeds ``theta``. All False for a rule that never
    relaxes this way (every rule but MARS, and MARS at theta = +inf)."""
    return BEHAVIOURS[rule.name].relaxable(rule, stat)


def uses_margin_facts(rule: Rule) -> bool:
    """Does ``rule`` judge a position by its margin facts (``RuleBehaviour.margin_facts``:
    MARS), so that the walks gather them (``top2``, ``margin_statistic``, ``in_top2``)?"""
    return BEHAVIOURS[rule.name].margin_facts


def _exceeds(stat: Any, threshold: float) -> Any:
    """Elementwise ``stat > threshold``, a torch statistic compared in float64."""
    if isinstance(stat, torch.Tensor):
        stat = stat.double()
    return stat > threshold


def stop_positions(drafts: torch.Tensor, logits: torch.Tensor, stops: torch.Tensor,
                   top1: torch.Tensor | None = None) -> torch.Tensor:
    """Where a relaxed rule must judge strictly so that it never decides where an output ends
    (issue 31): the draft is a stop token, or the target's top-1 is one. drafts [B, K] long,
    logits [B, K, V] (row k judges draft k), stops [B, S] long (each row's stop tokens: its EOS
    tokens and its stop strings' first tokens; -1 pads). Returns [B, K] bool.

    With the positions guarded, a stop token is emitted only where the target chooses it (the
    strict check keeps a draft stop token only as the target's own pick), and a position
    where the target would stop is never relaxed into going on. top1: logits' argmax [B, K],
    when the caller has it."""
    if drafts.numel() == 0:
        return torch.zeros(drafts.shape, dtype=torch.bool, device=drafts.device)
    stops = stops.to(drafts.device)
    if top1 is None:
        top1 = logits.argmax(dim=-1)  # [B, K]

    def hit(t: torch.Tensor) -> torch.Tensor:
        return (t.unsqueeze(-1) == stops.unsqueeze(-2)).any(dim=-1)

    return hit(drafts) | hit(top1)


# ----------------------------------------------------------------------------- the rules
# Each rule is ONE block here: a RuleBehaviour registered under its registry name (its name,
# knobs, bounds and when it relaxes at all are its registry.RuleSpec). A block says when a
# position relaxes (``condition``), the number a position is judged by (``statistic``) and
# the knob values where a replay can change (``critical_values``, for calibration's walk);
# MARS's block also says that the walks judge it by the margin facts (``margin_facts``) and
# where its margin check relaxes (``relaxable``).
#
# The per-token rules (every rule but MARS): a proposal is kept when it is the target's own
# token there (greedy: the top-1; sampling: the position's draw) OR the condition holds
# (unless the loop guard or the budget forbids relaxing there); otherwise the target's own
# token is emitted. The law of the token emitted at a position whose proposal is x is
# therefore: x itself when the condition holds, else exactly p (the strict law).


class RuleBehaviour:
    """What a rule does, beside its registry entry. Subclass it once per rule (static
    methods) and register it with ``@behaviour(NAME)``; the default ``decide`` is a per-token
    rule's (strict OR the condition)."""

    name: str = ""
    #: A per-token rule: a condition on each position's own facts (MARS is not one: it relaxes
    #: by the row's margin statistic and accepts only the target's top two there).
    per_token: bool = True
    #: Judged by the margin facts (MARS): the target's top two at each position, the margin
    #: statistic and ``relaxable``; the walks build them (chain.mars_facts) rather than a
    #: per-token rule's ``draft_facts``.
    margin_facts: bool = False

    @staticmethod
    def relaxable(rule: Rule, stat: Any) -> Any:
        """Elementwise bool: the margin check relaxes the position, its margin statistic
        ``stat`` exceeding the rule's threshold. All False but for MARS (``Mars.relaxable``)."""
        return _exceeds(stat, math.inf)

    @staticmethod
    def condition(rule: Rule, facts: PositionFacts) -> Any:
        """Elementwise bool: the rule relaxes the position (before the guard)."""
        raise ValueError(f"rule {rule.name!r} has no per-token condition")

    @staticmethod
    def statistic(rule: Rule, facts: PositionFacts) -> Any:
        """The number each position is judged by, for reports and provenance (default: the
        margin statistic if known, else nothing)."""
        return facts.statistics.get(rule.margin)

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        """Knob values to walk from the strict end outwards, where the replay of ``data``
        (calibration.collect.MarginData: flat numpy arrays of the recorded facts) changes."""
        raise ValueError(f"the {rule.name} rule has no knob to calibrate")

    @classmethod
    def relaxed_here(cls, rule: Rule, facts: PositionFacts) -> Any:
        """The condition where the loop guard and the budget allow relaxing (``guarded``)."""
        relax = cls.condition(rule, facts)
        return relax if facts.guarded is None else relax & ~facts.guarded

    @classmethod
    def decide(cls, rule: Rule, facts: PositionFacts) -> Decision:
        relax = cls.relaxed_here(rule, facts)
        return Decision(ok=facts.strict_ok | relax, relaxable=relax)


#: Every rule's behaviour by its registry name (tests/verification/test_rulebook.py: one per RULEBOOK entry).
BEHAVIOURS: dict[str, type[RuleBehaviour]] = {}


def behaviour(name: str) -> Callable[[type[RuleBehaviour]], type[RuleBehaviour]]:
    """Register a rule's behaviour under its registry name."""
    rule_spec(name)  # refuses a name the registry does not know

    def register(cls: type[RuleBehaviour]) -> type[RuleBehaviour]:
        cls.name = name
        BEHAVIOURS[name] = cls
        return cls
    return register


def walk_order(values: np.ndarray, rule: Rule) -> np.ndarray:
    """Distinct critical values ordered from the rule's strict end outwards, subsampled to
    MAX_CANDIDATES."""
    v = np.unique(values)
    if rule.spec.direction < 0:
        v = v[::-1]
    return subsample(v)


def subsample(v: np.ndarray) -> np.ndarray:
    """At most MAX_CANDIDATES values, evenly spread, the first and last kept."""
    if len(v) > MAX_CANDIDATES:
        v = v[np.unique(np.linspace(0, len(v) - 1, MAX_CANDIDATES).round().astype(int))]
    return v


@behaviour(STRICT)
class Strict(RuleBehaviour):
    """strict: keep a draft only where the target agrees (greedy: its argmax; sampling:
    the position's draw, marscli.verification.draws): lossless. Never relaxes."""

    per_token = False


@behaviour(MARS)
class Mars(RuleBehaviour):
    """MARS (Shi et al., arXiv 2601.15498, Algorithm 1 and the authors' sampling code): with
    target logits z1 >= z2 at a position, r = z2 / z1 (logit-ratio; or p2 / p1 = exp(z2 - z1),
    prob-ratio). The position is relaxable when z1 > 0 and r > theta (``Mars.relaxable``); there a
    proposal that is the target's top-1 or top-2 token (with p > 0) is kept outright,
    elsewhere the strict check decides; a proposal not kept gives way to the target's own
    token (greedy: its top-1; sampling: the position's draw: where the reference code rejects
    outright, a relaxed sampled position falls back to the draw)."""

    per_token = False
    margin_facts = True

    @staticmethod
    def relaxable(rule: Rule, stat: Any) -> Any:
        """MARS's margin check: relaxable where the margin statistic exceeds theta (nowhere
        at theta = +inf)."""
        return _exceeds(stat, rule.theta if rule.relaxes else math.inf)

    @classmethod
    def condition(cls, rule: Rule, facts: PositionFacts) -> Any:
        return cls.relaxable(rule, facts.statistics[rule.margin])

    @classmethod
    def decide(cls, rule: Rule, facts: PositionFacts) -> Decision:
        relax = cls.relaxed_here(rule, facts)
        ok = (relax & facts.in_top2) | (~relax & facts.strict_ok)
        return Decision(ok=ok, relaxable=relax)

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        """The sensitive statistic values c_0 > c_1 > ... (where relaxing changes the
        outcome: MARS and strict disagree there) themselves, then one just below the last:
        theta = c_i relaxes c_0 .. c_(i-1), the most relaxing theta that does so, and one value
        more lets the last one relax too. With no sensitive position at all, 1.0 (no statistic
        lies above it)."""
        stat = data.statistic(rule.margin)
        sensitive = data.in_top2 != (data.strict_ok > 0.5)
        c = subsample(np.unique(stat[sensitive & np.isfinite(stat)])[::-1])
        return np.r_[c, np.nextafter(c[-1], -math.inf)] if len(c) else np.asarray([1.0])


def open_positions(data: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """Where a per-token rule can change the outcome (strict rejects a draft of p > 0): the
    mask and p(x), p1 there."""
    open_ = (data.strict_ok < 0.5) & (data.p_draft > 0)
    return open_, data.p_draft[open_], data.p1[open_]


@behaviour(RATIO)
class Ratio(RuleBehaviour):
    """ratio (``rho`` = R in (0, 1]): relax where p(x) >= R * p1, x at any rank with p(x) > 0.
    R = 1 is strict. When sampling, any R < 1 accepts a draft that is the target's top-1
    outright (strict rejection sampling keeps it with probability p1 only), so the family is
    strict only at R = 1 itself; topk with D > 0 likewise. (Speculative cascades' deferral
    rule, Narasimhan et al. 2024, and the "relative probability" acceptance of several MLX
    engines.) Statistic: p(x) / p1."""

    @staticmethod
    def condition(rule: Rule, facts: PositionFacts) -> Any:
        px = _float64(facts.p_draft)
        return (px >= rule.rho * _float64(facts.p1)) & (px > 0)

    @staticmethod
    def statistic(rule: Rule, facts: PositionFacts) -> Any:
        return facts.p_draft / facts.p1

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        _, px, p1 = open_positions(data)
        v = np.minimum(np.nextafter(px / p1, 0.0), np.nextafter(1.0, 0.0))
        return walk_order(v[v > 0], rule)


@behaviour(TOPK)
class TopK(RuleBehaviour):
    """topk (``top_n`` = N >= 1, ``delta`` = D >= 0): relax where x is among the target's N
    most likely tokens (rank = 1 + the number of tokens with a larger logit) and
    p(x) >= p1 - D (TensorRT-LLM's relaxed acceptance for DeepSeek MTP: candidate set of the
    top-N, probability within delta of the top-1). D = 0 (or N = 1) is strict. Statistic:
    p1 - p(x)."""

    @staticmethod
    def condition(rule: Rule, facts: PositionFacts) -> Any:
        px = _float64(facts.p_draft)
        return (facts.rank <= rule.top_n) & (px >= _float64(facts.p1) - rule.delta) & (px > 0)

    @staticmethod
    def statistic(rule: Rule, facts: PositionFacts) -> Any:
        return facts.p1 - facts.p_draft

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        open_, px, p1 = open_positions(data)
        near = data.target_rank[open_] <= rule.top_n
        return walk_order(np.nextafter((p1 - px)[near], math.inf), rule)


@behaviour(TYPICAL)
class Typical(RuleBehaviour):
    """typical (``epsilon`` = E in (0, 1], ``alpha`` = A > 0; A defaults to sqrt(E)): relax
    where p(x) > min(E, A * exp(-H(p))), H the entropy of p in nats (Medusa's typical
    acceptance, Cai et al. 2024, Section 2.3.1, once vLLM's TypicalAcceptanceSampler). The
    first position that fails gets the target's token (greedy) or a draw whose law is p
    (sampling). With E = 1 and A = +inf the threshold is 1 and nothing relaxes: strict.
    Statistic: p(x)."""

    @staticmethod
    def condition(rule: Rule, facts: PositionFacts) -> Any:
        px, h = _float64(facts.p_draft), _float64(facts.entropy)
        lib = torch if isinstance(h, torch.Tensor) else np
        threshold = lib.minimum(lib.exp(-h) * rule.alpha, lib.full_like(h, rule.epsilon)) \
            if rule.alpha != math.inf else lib.full_like(h, rule.epsilon)
        return px > threshold

    @staticmethod
    def statistic(rule: Rule, facts: PositionFacts) -> Any:
        return facts.p_draft

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        """E < p, or E < (p e^H)^2 with alpha tied to sqrt(E); with alpha fixed E < p unless
        p > A e^-H already relaxes the position at any E."""
        open_, px, _ = open_positions(data)
        h = data.entropy[open_]
        if tie_alpha:
            c = np.maximum(px, (px * np.exp(h)) ** 2)
        else:
            c = np.where(px > rule.alpha * np.exp(-h), math.inf, px)
        v = np.nextafter(c[c <= 1.0], 0.0)
        return walk_order(v[v > 0], rule)


@behaviour(REGRET)
class Regret(RuleBehaviour):
    """regret (``budget`` = B >= 0; greedy only): accept the drafts of a step while the
    step's summed regret sum_i (z1_i - z(x_i)) over the drafts so far stays <= B (approximate
    speculative decoding's logit-gap budget; invariant to a constant shift of the logits). A
    tree sums along the root path. B = 0 is strict. Statistic: the summed regret so far."""

    @staticmethod
    def condition(rule: Rule, facts: PositionFacts) -> Any:
        return _float64(facts.regret) <= rule.budget

    @staticmethod
    def statistic(rule: Rule, facts: PositionFacts) -> Any:
        return facts.regret

    @staticmethod
    def critical_values(rule: Rule, data: Any, tie_alpha: bool) -> np.ndarray:
        g = data.grid()
        summed = g["regret"][g["valid"] & ~g["strict_ok"]]
        return walk_order(np.maximum(summed[np.isfinite(summed)], np.nextafter(0.0, 1.0)), rule)


def per_token(rule: Rule) -> bool:
    """Is ``rule`` a per-token rule that relaxes at its knobs (so the walks gather its
    per-token facts and judge each draft by its condition)?"""
    return rule.relaxes and BEHAVIOURS[rule.name].per_token


def statistic(rule: Rule, facts: PositionFacts) -> Any:
    """The number each position is judged by, for reports and provenance: MARS its margin
    statistic; ratio p(x)/p1; topk p1 - p(x); typical p(x); regret the summed regret so far;
    strict the margin statistic if known, else nothing."""
    return BEHAVIOURS[rule.name].statistic(rule, facts)


def decide(rule: Rule, facts: PositionFacts) -> Decision:
    """The per-position decision of every rule: judge every position on its own (the caller
    keeps the accepted prefix or path). A rule that does not relax at its knobs is strict;
    a ``guarded`` position (the loop guard or the relaxation budget) is judged strictly."""
    if not rule.relaxes:  # no margin needed: all False, of the facts' own type and shape
        return Decision(ok=facts.strict_ok, relaxable=facts.strict_ok & ~facts.strict_ok)
    return BEHAVIOURS[rule.name].decide(rule, facts)


def in_top2(drafts: Any, t1: Any, t2: Any, alive: Any) -> Any:
    """Elementwise bool: the draft is the target's top-1 or top-2 token and p(draft) > 0
    (``alive``) there: what MARS accepts at a relaxable position. drafts, t1, t2, alive of
    one shape."""
    return ((drafts == t1) | (drafts == t2)) & alive


def _float64(x: Any) -> Any:
    return x.double() if isinstance(x, torch.Tensor) else x.astype("float64")


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
    relaxable: Any  # bool: the check was relaxed here


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


def top2(logits: torch.Tensor, t1: torch.Tensor | None = None
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-1 and top-2 logits and token ids along the last dim.

    Ties resolve to the lowest token id, as torch.argmax (and so transformers' greedy
    search) does: top-1 is argmax; top-2 is argmax with the top-1 entry removed.
    t1: the argmax, when the caller has it already (a pass over the vocabulary saved).
    Returns (z1, z2, t1, t2), each shaped like ``logits[..., 0]``.
    """
    x = logits.float()
    if t1 is None:
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
