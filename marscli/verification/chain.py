"""The chain walk: one step's drafts verified by a rule, greedy and sampling, one row or a
batch; the sampling law and the random-draw policy.

Pure tensor functions: no model, no I/O, no hidden random state. Randomness comes in as
uniform draws (``step_uniforms`` says how many a step takes), so a result is a function of
its arguments alone, and a batch row's result never depends on the other rows. Words and how
a rule is built: marscli.verification.

Chain functions take drafts ``[B, K]``, target logits ``[B, K+1, V]`` and an optional
``draft_len`` ``[B]``: row b proposed only its first ``draft_len[b]`` drafts (the rest is
padding and never accepted). The token emitted after the accepted prefix is a correction when
the row rejected one of its own drafts and a bonus when it accepted all of them.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from marscli.verification.registry import MARS, SAMPLING_MODE, STRICT, Rule
from marscli.verification.rules import (
    NOT_RELAXABLE,
    Decision,
    PositionFacts,
    decide,
    draft_facts,
    in_top2,
    margin_statistic,
    over_budget,
    per_token,
    relaxed_positions,
    statistic,
    top2,
)

#: The walks' rule when none is given.
STRICT_RULE = Rule(STRICT)


def step_uniforms(generator: torch.Generator, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random-draw policy of a sampling step with n drafts (chain) or n nodes (tree):
    n acceptance uniforms, then one for the correction/bonus. A fixed count per step keeps a
    record's random stream a function of its own draft lengths only (so of no batch)."""
    u_accept = torch.rand(n, generator=generator)  # [n]
    u_sample = torch.rand(1, generator=generator)  # [1]
    return u_accept, u_sample


# ----------------------------------------------------------------------------- sampling


def sampling_probs(
    logits: torch.Tensor,  # [..., V]
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The target's sampling distribution, float32 [..., V].

    Same order and tie rules as transformers' warpers: temperature, then top-k (keeps every
    token whose logit reaches the k-th largest), then top-p (drops the low tail whose mass is
    at most 1 - top_p, keeping at least one token). Filtered tokens get probability 0.
    """
    assert temperature > 0, "sampling_probs needs temperature > 0; greedy uses argmax"
    x = logits.float() / temperature
    V = x.shape[-1]
    if 0 < top_k < V:
        kth = torch.topk(x, top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, -math.inf)
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=False)
        cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1.0 - top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, idx, remove_sorted)
        x = x.masked_fill(remove, -math.inf)
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [B, V], u [B] in [0, 1) -> token ids [B] long.

    Deterministic given u; never returns a token of probability 0.
    """
    cdf = probs.double().cumsum(dim=-1)  # [B, V]
    total = cdf[:, -1:]
    x = u.to(total.device).double().unsqueeze(1) * total
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    idx = idx.clamp(max=probs.shape[-1] - 1)
    # u * total can round up to total: fall back to the most likely token in that corner.
    bad = probs.gather(1, idx.unsqueeze(1)).squeeze(1) <= 0
    if bool(bad.any()):
        idx = torch.where(bad, probs.argmax(dim=-1), idx)
    return idx


def residual(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) per row: the correction's law after a strict rejection (Leviathan
    et al.). p: [B, V]; q None means one-hot at `draft` [B]."""
    if q is None:
        r = p.scatter(1, draft.unsqueeze(1), 0.0)
    else:
        r = (p - q).clamp(min=0.0)
    mass = r.sum(dim=-1, keepdim=True)
    # Rejection implies p(x) < q(x), so the residual has mass; guard rounding anyway.
    return torch.where(mass > 0, r / mass.clamp(min=1e-30), p)


def strict_sampling_accepts(
    drafts: torch.Tensor,  # [B, K] long
    p: torch.Tensor,  # [B, K, V] target sampling probabilities at the K draft positions
    u_accept: torch.Tensor,  # [B, K] uniforms in [0, 1)
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None: one-hot q
) -> torch.Tensor:
    """[B, K] bool: would strict rejection sampling accept each draft on its own
    (u < min(1, p(x) / q(x)) and p(x) > 0)? Positions are judged independently: the accepted
    prefix is the caller's business."""
    B, K = drafts.shape
    p_x = p.gather(2, drafts.unsqueeze(2)).squeeze(2)  # [B, K]
    if draft_probs is None:
        q_x = torch.ones_like(p_x)
    else:
        assert draft_probs.shape == (B, K, p.shape[-1]), f"draft_probs {tuple(draft_probs.shape)}"
        q_x = draft_probs.gather(2, drafts.unsqueeze(2)).squeeze(2).float()
    # Compare in float64: a float64 uniform just below 1 must not round up to 1 and reject a
    # certain draft.
    ok = u_accept.double() < (p_x.double() / q_x.double().clamp(min=1e-30)).clamp(max=1.0)
    return ok & (p_x > 0)


# ----------------------------------------------------------------------------- chains


@dataclass
class VerifyResult:
    """Outcome of verifying one step for every row of a batch."""

    num_accepted: torch.Tensor  # [B] long, 0..draft_len[b]
    next_token: torch.Tensor  # [B] long: correction or bonus
    relaxed: torch.Tensor  # [B, K] bool: accepted only thanks to the relaxed rule
    relaxable: torch.Tensor  # [B, K] bool: the rule relaxed the check at that draft position
    statistic: torch.Tensor  # [B, K] float32: the rule's margin statistic at each position
    #: [B] bool or None: the row's first rejection is a relaxation the loop guard or the
    #: relaxation budget refused (the rule alone would have accepted the draft there)
    refused: torch.Tensor | None = None

    def emitted(self, drafts: torch.Tensor, b: int) -> list[int]:
        """Tokens row b emits this step: its accepted drafts, then the next token."""
        n = int(self.num_accepted[b])
        return drafts[b, :n].tolist() + [int(self.next_token[b])]

    def row(self, b: int, k: int) -> VerifyResult:
        """Row b's result alone, cut to its k drafts ([1, k] shapes)."""
        return VerifyResult(self.num_accepted[b: b + 1], self.next_token[b: b + 1],
                            self.relaxed[b: b + 1, :k], self.relaxable[b: b + 1, :k],
                            self.statistic[b: b + 1, :k],
                            None if self.refused is None else self.refused[b: b + 1])

    def host_rows(self, statistic: bool = False, extra: torch.Tensor | None = None) -> list[RowVerdict]:
        """Every row's verdicts on the host (``RowVerdict``), with the rule's statistic when
        asked and the row of ``extra`` ([B, X] long, e.g. packed logprobs), in ONE
        device-to-host transfer for the whole batch."""
        K = self.relaxed.shape[1]
        return [RowVerdict.unpack(row, K, statistic)
                for row in RowVerdict.pack(self, statistic, extra).cpu().tolist()]


@dataclass
class RowVerdict:
    """One row's verdicts of a step, on the host. ``pack`` lays a batch's verdicts out as one
    [B, W] long tensor on the device; ``unpack`` reads one row of it back by name."""

    num_accepted: int
    next_token: int  # correction or bonus
    relaxed: list[int]  # [K] 1: accepted only thanks to the relaxed rule
    relaxable: list[int]  # [K] 1: the rule relaxed the check there
    refused: int  # 1: the first rejection is a relaxation the guard or the budget refused
    statistic: list[float] | None  # [K] the rule's statistic (float32 values), when packed
    extra: list[int]  # the caller's own columns (packed logprobs)

    @staticmethod
    def pack(result: VerifyResult, statistic: bool = False, extra: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 3 + 2K (+ K) (+ X)] long: n, next token, relaxed flags (K), relaxable flags (K),
        refused, then the statistic's float32 bits (K) when asked, then ``extra`` [B, X]."""
        refused = (torch.zeros_like(result.num_accepted) if result.refused is None
                   else result.refused.long()).unsqueeze(1)
        parts = [result.num_accepted.unsqueeze(1), result.next_token.unsqueeze(1),
                 result.relaxed.long(), result.relaxable.long(), refused]
        if statistic:
            parts.append(result.statistic.float().contiguous().view(torch.int32).long())
        if extra is not None:
            parts.append(extra.long())
        return torch.cat(parts, dim=1)

    @classmethod
    def unpack(cls, row: list[int], K: int, statistic: bool = False) -> RowVerdict:
        """One row of ``pack``'s tensor, as Python ints (K: the step's draft slots)."""
        at = 3 + 2 * K
        stats = None
        if statistic:
            stats = [float_bits(v) for v in row[at: at + K]]
            at += K
        return cls(row[0], row[1], row[2: 2 + K], row[2 + K: 2 + 2 * K], row[2 + 2 * K], stats, row[at:])


def float_bits(v: int) -> float:
    """A float32 sent to the host as its int32 bit pattern (in a long) -> the float."""
    return struct.unpack("<f", struct.pack("<i", int(v)))[0]


def _draft_mask(drafts: torch.Tensor, draft_len: torch.Tensor | None) -> torch.Tensor:
    """[B, K] bool: which draft slots hold real proposals."""
    B, K = drafts.shape
    if draft_len is None:
        return torch.ones(B, K, dtype=torch.bool, device=drafts.device)
    pos = torch.arange(K, device=drafts.device).unsqueeze(0)
    return pos < draft_len.to(drafts.device).unsqueeze(1)


def _check_shapes(drafts: torch.Tensor, logits: torch.Tensor) -> None:
    assert drafts.dim() == 2, f"drafts must be [B, K], got {tuple(drafts.shape)}"
    assert logits.dim() == 3, f"logits must be [B, K+1, V], got {tuple(logits.shape)}"
    B, K = drafts.shape
    assert logits.shape[:2] == (B, K + 1), (
        f"logits {tuple(logits.shape)} do not match drafts {tuple(drafts.shape)}: need [B, K+1, V]"
    )


def _prefix_len(ok: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] long: length of the leading run of True."""
    if ok.shape[1] == 0:
        return torch.zeros(ok.shape[0], dtype=torch.long, device=ok.device)
    return ok.long().cumprod(dim=1).sum(dim=1)


@dataclass
class StepLimits:
    """Where a step's rule may act at all: the real drafts and the two limits on relaxing."""

    valid: torch.Tensor  # [B, K] bool: row b proposed only its first draft_len[b] drafts
    guard: torch.Tensor | None  # [B, K] bool: never relax here (the loop guard, spans, stops)
    relax_left: torch.Tensor | None  # [B] long: each row's remaining relaxation budget


def verify(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V] raw target logits
    *,
    rule: Rule = STRICT_RULE,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    u_accept: torch.Tensor | None = None,  # [B, K]
    u_sample: torch.Tensor | None = None,  # [B]
    draft_probs: torch.Tensor | None = None,  # [B, K, V]; None: deterministic drafter (one-hot q)
    draft_len: torch.Tensor | None = None,  # [B]
    guard: torch.Tensor | None = None,  # [B, K] bool: never relax here (the loop guard)
    relax_left: torch.Tensor | None = None,  # [B] long: relaxations each row may still make
) -> VerifyResult:
    """Verify a chain step for every row by ``rule``: the greedy walk when temperature == 0,
    else the sampling walk.

    ``guard`` marks positions the rule must judge strictly (``PositionFacts.guarded``);
    ``relax_left`` is each row's remaining relaxation budget: a position after that many
    relaxations in the step is judged strictly too (the record is strict from there on).
    """
    _check_shapes(drafts, logits)
    limits = StepLimits(_draft_mask(drafts, draft_len), guard, relax_left)
    if temperature == 0.0:
        return greedy_walk(drafts, logits, rule, limits)
    if SAMPLING_MODE not in rule.modes:
        raise ValueError(f"the {rule.name} rule is defined for greedy decoding only")
    assert u_accept is not None and u_sample is not None, "sampling needs uniforms"
    return sampling_walk(drafts, logits, rule, limits, temperature, top_k, top_p, u_accept, u_sample,
                         draft_probs)


def greedy_walk(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    rule: Rule,
    limits: StepLimits,
) -> VerifyResult:
    """Greedy: the strict check is draft == argmax (gpt-fast's greedy acceptance); the next
    token is the argmax after the accepted prefix (a correction, or the bonus)."""
    B, K = drafts.shape
    logits_k = logits[:, :K]  # [B, K, V] row k judges draft k
    argmax = logits.float().argmax(dim=-1)  # [B, K+1]
    strict_ok = drafts == argmax[:, :K]
    if per_token(rule):
        facts = per_token_facts(rule, logits_k, drafts, torch.softmax(logits_k.float(), dim=-1),
                                strict_ok, limits.valid)
    elif rule.name == MARS:
        alive = logits_k.float().gather(-1, drafts.unsqueeze(-1)).squeeze(-1) > -math.inf
        facts = mars_facts(rule, logits_k, drafts, alive, strict_ok)
        facts.in_top2 = facts.in_top2 | strict_ok  # greedy's strict check is the top-1 itself
    else:  # strict, or a rule at its strict end: no statistic needed, none computed
        facts = PositionFacts({rule.margin: torch.full((B, K), NOT_RELAXABLE, device=drafts.device)},
                              strict_ok, strict_ok)
    decision, refused = guarded_decision(rule, facts, limits)
    n, relaxed, relaxable = accepted_prefix(decision, strict_ok, limits.valid)
    next_token = argmax.gather(1, n.unsqueeze(1)).squeeze(1)  # [B]
    return VerifyResult(n, next_token, relaxed, relaxable, position_statistic(rule, facts), refused)


def sampling_walk(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    rule: Rule,
    limits: StepLimits,
    temperature: float,
    top_k: int,
    top_p: float,
    u_accept: torch.Tensor,  # [B, K]
    u_sample: torch.Tensor,  # [B]
    draft_probs: torch.Tensor | None,  # [B, K, V]; None: one-hot q
) -> VerifyResult:
    """Sampling: the strict check is Leviathan et al.'s u < min(1, p(x) / q(x)) (transformers'
    _speculative_sampling, vLLM's rejection sampler). A rejection judged by it draws the
    correction from norm(max(0, p - q)), one at a relaxable position from p itself; after all
    drafts a bonus from p. With a strict rule this reproduces the target's law exactly."""
    B, K = drafts.shape
    logits_k = logits[:, :K]  # [B, K, V]
    p = sampling_probs(logits, temperature, top_k, top_p)  # [B, K+1, V]
    strict_ok = strict_sampling_accepts(drafts, p[:, :K], u_accept, draft_probs)  # [B, K]
    if per_token(rule):
        facts = per_token_facts(rule, logits_k, drafts, p[:, :K], strict_ok, limits.valid)
    else:  # MARS, or strict (whose statistic is reported all the same)
        alive = p[:, :K].gather(2, drafts.unsqueeze(2)).squeeze(2) > 0  # [B, K]
        facts = mars_facts(rule, logits_k, drafts, alive, strict_ok)
    decision, refused = guarded_decision(rule, facts, limits)
    n, relaxed, relaxable = accepted_prefix(decision, strict_ok, limits.valid)
    # The next token: from row n of p, or of the residual when the strict check rejected there.
    rows = torch.arange(B, device=drafts.device)
    p_n = p[rows, n]  # [B, V]
    dist = p_n
    if K > 0:
        n_c = n.clamp(max=K - 1)
        rejected_own = n < limits.valid.sum(dim=1)  # the row rejected one of its own drafts
        use_residual = rejected_own & ~relaxable[rows, n_c]
        if bool(use_residual.any()):
            q_n = None if draft_probs is None else draft_probs[rows, n_c].float()
            dist = torch.where(use_residual.unsqueeze(1), residual(p_n, q_n, drafts[rows, n_c]), p_n)
    next_token = sample_from(dist, u_sample)  # [B]
    return VerifyResult(n, next_token, relaxed, relaxable, position_statistic(rule, facts), refused)


def position_statistic(rule: Rule, facts: PositionFacts) -> torch.Tensor:
    """[B, K] float32: what each position reports: a per-token rule's own statistic, else
    (MARS, strict) the margin statistic."""
    return statistic(rule, facts).float() if per_token(rule) else facts.statistics[rule.margin]


def mars_facts(
    rule: Rule,
    logits_k: torch.Tensor,  # [B, K, V] raw target logits judging the drafts
    drafts: torch.Tensor,  # [B, K] long
    alive: torch.Tensor,  # [B, K] bool: p(draft) > 0
    strict_ok: torch.Tensor,  # [B, K] bool
) -> PositionFacts:
    """MARS's facts (paper, Algorithm 1): the target's logits z1 >= z2 at each position, the
    margin statistic r (z2 / z1, relaxable only where z1 > 0; or exp(z2 - z1)) that ``decide``
    compares with theta, and whether the draft is the top-1 or top-2 token."""
    z1, z2, t1, t2 = top2(logits_k)  # each [B, K]
    stat = margin_statistic(z1, z2, rule.margin)
    return PositionFacts({rule.margin: stat}, in_top2(drafts, t1, t2, alive), strict_ok)


def per_token_facts(
    rule: Rule,
    logits_k: torch.Tensor,  # [B, K, V]
    drafts: torch.Tensor,  # [B, K] long
    probs_k: torch.Tensor,  # [B, K, V] target probabilities (sampling law; T = 1 if greedy)
    strict_ok: torch.Tensor,  # [B, K] bool
    valid: torch.Tensor,  # [B, K] bool
) -> PositionFacts:
    """A per-token rule's facts of a chain step; the regret is summed along each row's drafts
    (padding adds nothing: it is never accepted)."""
    f = draft_facts(logits_k, drafts, probs_k, rule.needs)
    if "regret" in f:
        f["regret"] = torch.where(valid, f["regret"], torch.zeros_like(f["regret"])).cumsum(dim=1)
    return PositionFacts({}, None, strict_ok, **f)


def guarded_decision(
    rule: Rule,
    facts: PositionFacts,  # [B, K] each
    limits: StepLimits,
) -> tuple[Decision, torch.Tensor | None]:
    """The rule's decision with the loop guard and the relaxation budget applied, and
    ``refused`` [B] bool (None without guard and budget): the row's first rejection is a
    relaxation the guard or the budget refused (the rule alone would have accepted there)."""
    valid, guard, relax_left = limits.valid, limits.guard, limits.relax_left
    decision = decide(rule, facts)
    if not rule.relaxes or (guard is None and relax_left is None):
        return decision, None
    K = valid.shape[1]
    # Would-be relaxations (judged on their own) that the guard or the budget refuses.
    wants = decision.ok & decision.relaxable & ~facts.strict_ok & valid  # [B, K]
    guarded = torch.zeros_like(wants) if guard is None else guard.to(wants.device) & valid
    if relax_left is not None:
        guarded = guarded | over_budget(wants, relax_left.to(wants.device))
    facts.guarded = guarded
    decision = decide(rule, facts)
    if K == 0:
        return decision, None
    n_ok = _prefix_len(decision.ok & valid)
    at = n_ok.clamp(max=K - 1).unsqueeze(1)
    return decision, (wants & guarded).gather(1, at).squeeze(1) & (n_ok < K)


def accepted_prefix(
    decision: Decision,
    strict_ok: torch.Tensor,  # [B, K] bool
    valid: torch.Tensor,  # [B, K] bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The accepted prefix of each row: n [B] long, relaxed [B, K] (accepted only thanks to
    the rule) and relaxable [B, K] (the rule relaxed the check there)."""
    relaxable = decision.relaxable & valid
    n = _prefix_len(decision.ok & valid)
    accepted = torch.arange(valid.shape[1], device=valid.device).unsqueeze(0) < n.unsqueeze(1)
    return n, relaxed_positions(accepted, relaxable, strict_ok), relaxable


def verify_rows(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    draft_len: torch.Tensor,  # [B] long
    rule: Rule,
    sampling: Sequence[Any],  # per row: a SamplingParams (temperature, top_k, top_p)
    u_accept: torch.Tensor | None = None,  # [B, K]: rows that sample; anything for greedy rows
    u_sample: torch.Tensor | None = None,  # [B]
    draft_probs: torch.Tensor | None = None,  # [B, K, V]
    guard: torch.Tensor | None = None,  # [B, K] bool: never relax here (the loop guard)
    relax_left: torch.Tensor | None = None,  # [B] long: each row's remaining relaxations
) -> VerifyResult:
    """One verification for a whole batch whose rows may decode differently (per-record
    temperature, top-k, top-p). Rows sharing settings are verified together (one group in
    the usual run); every row's result is what ``verify`` gives it alone."""
    B, K = drafts.shape
    keys = [(s.temperature, s.top_k, s.top_p) if not s.greedy else (0.0, 0, 1.0) for s in sampling]
    groups: dict[tuple, list[int]] = {}
    for b, key in enumerate(keys):
        groups.setdefault(key, []).append(b)

    def one(idx: list[int] | None, key: tuple) -> VerifyResult:
        sel = (lambda t: t) if idx is None else (lambda t: None if t is None else t[idx])
        temperature, top_k, top_p = key
        return verify(sel(drafts), sel(logits), rule=rule, temperature=temperature, top_k=top_k,
                      top_p=top_p, u_accept=None if temperature == 0.0 else sel(u_accept),
                      u_sample=None if temperature == 0.0 else sel(u_sample),
                      draft_probs=None if temperature == 0.0 else sel(draft_probs),
                      draft_len=sel(draft_len), guard=sel(guard), relax_left=sel(relax_left))

    if len(groups) == 1:
        return one(None, keys[0])
    out = VerifyResult(torch.zeros(B, dtype=torch.long, device=drafts.device),
                       torch.zeros(B, dtype=torch.long, device=drafts.device),
                       torch.zeros(B, K, dtype=torch.bool, device=drafts.device),
                       torch.zeros(B, K, dtype=torch.bool, device=drafts.device),
                       torch.zeros(B, K, device=drafts.device),
                       torch.zeros(B, dtype=torch.bool, device=drafts.device))
    for key, idx in groups.items():
        part = one(idx, key)
        ix = torch.tensor(idx, dtype=torch.long, device=drafts.device)
        for name in ("num_accepted", "next_token", "relaxed", "relaxable", "statistic"):
            getattr(out, name)[ix] = getattr(part, name)
        if part.refused is not None:
            out.refused[ix] = part.refused
    return out
