"""The chain walk: one step's drafts verified by a rule, greedy and sampling, one row or a
batch; the sampling law.

Pure tensor functions: no model, no I/O, no hidden random state. A sampled position's draw
comes from the record's seed and the position (marscli.verification.draws), so a result is a
function of its arguments alone, and a batch row's result never depends on the other rows.
Words and how a rule is built: marscli.verification.

**Position-wise rules.** At every output position the row's drafter has a proposal for that
position, made from the row's own text so far (or none). The rule judges it on the target's
logits there: it emits the proposal when the rule keeps it (it is the target's own token,
or the rule relaxes it), else the target's own token (greedy: its top-1; sampling: the
position's draw). A chain step only computes that text faster: row b's drafts ARE its
proposals for the step's first ``draft_len[b]`` positions (each made from the drafts before
it), and ``bonus[b]`` is its proposal for the position after them; a draft is accepted when
it is the token the rule emits there, and the token emitted after the accepted prefix is the
rule's at that position (a correction when the rule replaced the row's own draft, else the
bonus position's). Without ``bonus`` the position after the drafts has no proposal, which
is the paper's Algorithm 1 (relax only the drafted positions).

Chain functions take drafts ``[B, K]``, target logits ``[B, K+1, V]`` and an optional
``draft_len`` ``[B]``: row b proposed only its first ``draft_len[b]`` drafts (the rest is
padding and never accepted). Per-position outputs are ``[B, K+1]``: position j judges draft j
(j < draft_len[b]) or the bonus proposal (j == draft_len[b]).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from marscli.verification import draws
from marscli.verification.draws import coupled_draw, position_keys
from marscli.verification.registry import SAMPLING_MODE, STRICT, Rule
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
    statistic,
    top2,
    uses_margin_facts,
)

#: The walks' rule when none is given.
STRICT_RULE = Rule(STRICT)
#: A position without a proposal (``bonus``, padding).
NO_PROPOSAL = -1


# ----------------------------------------------------------------------------- sampling


def sampled_groups(samplings: Sequence[Any]) -> dict[tuple[float, int, float], list[int]]:
    """The sampled rows (not greedy) grouped by their (temperature, top_k, top_p): one
    sampling law, and one draw call, a group."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, s in enumerate(samplings):
        if not s.greedy:
            groups.setdefault((s.temperature, s.top_k, s.top_p), []).append(i)
    return groups


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


def sampled_draws(
    p: torch.Tensor,  # [B, W, V] the target's sampling law at each position
    seeds: torch.Tensor,  # [B] long: each row's record seed
    positions: torch.Tensor,  # [B] long: the output position of each row's first row of p
    need: torch.Tensor | None = None,  # [B, W] bool: the positions to draw (None: all)
) -> torch.Tensor:
    """[B, W] long: the position's draw (marscli.verification.draws.coupled_draw) at every
    needed position (0 elsewhere): a function of the seed, the position and p only."""
    B, W, V = p.shape
    dev = p.device
    pos = positions.to(dev).long().view(B, 1) + torch.arange(W, device=dev).view(1, W)  # [B, W]
    keys = position_keys(seeds.to(dev).long().view(B, 1).expand(B, W), pos)  # [B, W]
    if need is None:
        return coupled_draw(p.reshape(B * W, V), keys.reshape(-1)).view(B, W)
    need = need.to(dev)
    if dev.type in draws.DENSE_DEVICES:  # every position drawn, no host read (the same draws)
        drawn = coupled_draw(p.reshape(B * W, V), keys.reshape(-1)).view(B, W)
        return torch.where(need, drawn, torch.zeros_like(drawn))
    out = torch.zeros(B, W, dtype=torch.long, device=dev)
    if bool(need.any()):
        out[need] = coupled_draw(p[need], keys[need])
    return out


# ----------------------------------------------------------------------------- chains


@dataclass
class VerifyResult:
    """Outcome of verifying one step for every row of a batch (W = K + 1 positions a row)."""

    num_accepted: torch.Tensor  # [B] long, 0..draft_len[b]
    next_token: torch.Tensor  # [B] long: the token emitted after the accepted drafts
    relaxed: torch.Tensor  # [B, W] bool: emitted only thanks to the relaxed rule (positions <= n)
    relaxable: torch.Tensor  # [B, W] bool: the rule relaxed the check at that position
    statistic: torch.Tensor  # [B, W] float32: the rule's statistic at each position
    #: [B] bool or None: the proposal at the row's position n (the one whose token the rule
    #: chose) is a relaxation the loop guard or the relaxation budget refused
    refused: torch.Tensor | None = None
    #: [B, W] bool: the proposal there is the target's own token (greedy: its top-1;
    #: sampling: the position's draw); None when built by hand
    strict_ok: torch.Tensor | None = None
    #: [B] float64 or None: the regret rule's summed regret the next position starts from
    regret: torch.Tensor | None = None

    def emitted(self, drafts: torch.Tensor, b: int) -> list[int]:
        """Tokens row b emits this step: its accepted drafts, then the next token."""
        n = int(self.num_accepted[b])
        return drafts[b, :n].tolist() + [int(self.next_token[b])]

    def row(self, b: int, k: int) -> VerifyResult:
        """Row b's result alone, cut to its k drafts and the position after them ([1, k+1])."""
        return VerifyResult(self.num_accepted[b: b + 1], self.next_token[b: b + 1],
                            self.relaxed[b: b + 1, : k + 1], self.relaxable[b: b + 1, : k + 1],
                            self.statistic[b: b + 1, : k + 1],
                            None if self.refused is None else self.refused[b: b + 1],
                            None if self.strict_ok is None else self.strict_ok[b: b + 1, : k + 1],
                            None if self.regret is None else self.regret[b: b + 1])

    def host_rows(self, statistic: bool = False, extra: torch.Tensor | None = None) -> list[RowVerdict]:
        """Every row's verdicts on the host (``RowVerdict``), with the rule's statistic when
        asked and the row of ``extra`` ([B, X] long, e.g. packed logprobs), in ONE
        device-to-host transfer for the whole batch."""
        W = self.relaxed.shape[1]
        regret = self.regret is not None
        return [RowVerdict.unpack(row, W, statistic, regret)
                for row in RowVerdict.pack(self, statistic, extra).cpu().tolist()]


@dataclass
class RowVerdict:
    """One row's verdicts of a step, on the host. ``pack`` lays a batch's verdicts out as one
    [B, X] long tensor on the device; ``unpack`` reads one row of it back by name."""

    num_accepted: int
    next_token: int
    relaxed: list[int]  # [W] 1: emitted only thanks to the relaxed rule
    relaxable: list[int]  # [W] 1: the rule relaxed the check there
    refused: int  # 1: the proposal at position n is a relaxation the guard or the budget refused
    statistic: list[float] | None  # [W] the rule's statistic (float32 values), when packed
    extra: list[int]  # the caller's own columns (packed logprobs)
    regret: float | None = None  # the regret rule's summed regret after the step

    @staticmethod
    def pack(result: VerifyResult, statistic: bool = False, extra: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 3 + 2W (+ W) (+ 1) (+ X)] long: n, next token, relaxed flags (W), relaxable
        flags (W), refused, then the statistic's float32 bits (W) when asked, the regret's
        float64 bits when the result has it, then ``extra`` [B, X]."""
        refused = (torch.zeros_like(result.num_accepted) if result.refused is None
                   else result.refused.long()).unsqueeze(1)
        parts = [result.num_accepted.unsqueeze(1), result.next_token.unsqueeze(1),
                 result.relaxed.long(), result.relaxable.long(), refused]
        if statistic:
            parts.append(result.statistic.float().contiguous().view(torch.int32).long())
        if result.regret is not None:
            parts.append(result.regret.double().contiguous().view(torch.int64).unsqueeze(1))
        if extra is not None:
            parts.append(extra.long())
        return torch.cat(parts, dim=1)

    @classmethod
    def unpack(cls, row: list[int], W: int, statistic: bool = False, regret: bool = False) -> RowVerdict:
        """One row of ``pack``'s tensor, as Python values (W: the step's positions, K + 1)."""
        at = 3 + 2 * W
        stats = None
        if statistic:
            stats = [float_bits(v) for v in row[at: at + W]]
            at += W
        carried = None
        if regret:
            carried = struct.unpack("<d", struct.pack("<q", int(row[at])))[0]
            at += 1
        return cls(row[0], row[1], row[2: 2 + W], row[2 + W: 2 + 2 * W], row[2 + 2 * W], stats, row[at:],
                   carried)


def float_bits(v: int) -> float:
    """A float32 sent to the host as its int32 bit pattern (in a long) -> the float."""
    return struct.unpack("<f", struct.pack("<i", int(v)))[0]


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
class StepProposals:
    """A step's proposals laid out by position ([B, W], W = K + 1)."""

    tokens: torch.Tensor  # [B, W] long: the proposal at each position (0 where there is none)
    has: torch.Tensor  # [B, W] bool: a proposal exists there
    drafted: torch.Tensor  # [B, K] bool: a real draft (j < draft_len[b])
    reach: torch.Tensor  # [B, W] bool: the step can reach the position (j <= draft_len[b])

    @staticmethod
    def of(drafts: torch.Tensor, draft_len: torch.Tensor | None, bonus: torch.Tensor | None) -> StepProposals:
        B, K = drafts.shape
        dev = drafts.device
        dl = (torch.full((B,), K, dtype=torch.long, device=dev) if draft_len is None
              else draft_len.to(dev).long())
        j = torch.arange(K + 1, device=dev).view(1, K + 1)
        drafted = j[:, :K] < dl.view(B, 1)
        tokens = torch.cat([torch.where(drafted, drafts, torch.zeros_like(drafts)),
                            torch.zeros(B, 1, dtype=torch.long, device=dev)], 1)
        has = torch.cat([drafted, torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
        if bonus is not None:
            b = bonus.to(dev).long()
            at = j == dl.view(B, 1)  # [B, W] the position after each row's drafts
            given = at & (b >= 0).view(B, 1)
            tokens = torch.where(given, b.clamp(min=0).view(B, 1), tokens)
            has = has | given
        return StepProposals(tokens, has, drafted, j <= dl.view(B, 1))


def verify(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V] raw target logits
    *,
    rule: Rule = STRICT_RULE,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    draft_len: torch.Tensor | None = None,  # [B]
    bonus: torch.Tensor | None = None,  # [B] long: the proposal after the drafts (NO_PROPOSAL: none)
    seeds: torch.Tensor | None = None,  # [B] long: the records' seeds (sampling)
    positions: torch.Tensor | None = None,  # [B] long: output position of logits row 0 (sampling)
    guard: torch.Tensor | None = None,  # [B, K+1] (or [B, K]) bool: never relax here
    relax_left: torch.Tensor | None = None,  # [B] long: relaxations each row may still make
    regret_carry: torch.Tensor | None = None,  # [B] float64: the regret rule's sum so far
    top1: torch.Tensor | None = None,  # [B, K+1] long: logits' argmax, when the caller has it
) -> VerifyResult:
    """Verify a chain step for every row by ``rule``, position by position (the module's
    docstring): greedy when temperature == 0, else sampling with the positions' draws.

    ``guard`` marks positions the rule must judge strictly (``PositionFacts.guarded``);
    ``relax_left`` is each row's remaining relaxation budget: a position after that many
    relaxations in the step is judged strictly too (the record is strict from there on).
    """
    _check_shapes(drafts, logits)
    B, K = drafts.shape
    W = K + 1
    dev = drafts.device
    props = StepProposals.of(drafts, draft_len, bonus)
    x = props.tokens
    if guard is not None and guard.shape[1] == K:  # the bonus position unguarded
        guard = torch.cat([guard.to(dev), torch.zeros(B, 1, dtype=torch.bool, device=dev)], 1)
    if temperature == 0.0:
        z = logits.float()
        own = z.argmax(dim=-1) if top1 is None else top1  # [B, W] the target's token: its top-1
        alive = z.gather(-1, x.unsqueeze(-1)).squeeze(-1) > -math.inf
        probs = torch.softmax(z, dim=-1) if per_token(rule) else None
    else:
        if SAMPLING_MODE not in rule.modes:
            raise ValueError(f"the {rule.name} rule is defined for greedy decoding only")
        assert seeds is not None and positions is not None, "sampling needs the records' seeds and positions"
        probs = sampling_probs(logits, temperature, top_k, top_p)  # [B, W, V]
        own = sampled_draws(probs, seeds, positions, props.reach)  # [B, W] the target's token: its draw
        alive = probs.gather(-1, x.unsqueeze(-1)).squeeze(-1) > 0
    strict_ok = props.has & (x == own)
    if per_token(rule):
        facts = per_token_facts(rule, logits, x, probs, strict_ok, props.has, regret_carry)
    elif uses_margin_facts(rule):  # MARS
        facts = mars_facts(rule, logits, x, alive, strict_ok, top1)
    else:  # strict, or a rule at its strict end: no statistic needed, none computed
        facts = PositionFacts({rule.margin: torch.full((B, W), NOT_RELAXABLE, device=dev)}, strict_ok, strict_ok)
    decision, refusals = guarded_decision(rule, facts, props.has, guard, relax_left)
    # [B, W] the rule emits the proposal there (its own token always: a sampled MARS position
    # it relaxes keeps a proposal in the top two, and one that is the draw all the same)
    keep = (decision.ok | strict_ok) & props.has & props.reach
    n = _prefix_len(keep[:, :K] & props.drafted)  # [B]
    rows = torch.arange(B, device=dev)
    next_token = torch.where(keep[rows, n], x[rows, n], own[rows, n])
    emitted = torch.arange(W, device=dev).view(1, W) <= n.view(B, 1)
    relaxed = keep & decision.relaxable & ~strict_ok & emitted
    relaxable = decision.relaxable & props.has & props.reach
    refused = None if refusals is None else refusals[rows, n]
    regret = None
    if facts.regret is not None and regret_carry is not None:
        regret = torch.where(keep[rows, n], facts.regret[rows, n].double(),
                             torch.zeros(B, dtype=torch.float64, device=dev))
    return VerifyResult(n, next_token, relaxed, relaxable, position_statistic(rule, facts), refused,
                        strict_ok, regret)


def position_statistic(rule: Rule, facts: PositionFacts) -> torch.Tensor:
    """[B, W] float32: what each position reports: a per-token rule's own statistic, else
    (MARS, strict) the margin statistic."""
    return statistic(rule, facts).float() if per_token(rule) else facts.statistics[rule.margin]


def mars_facts(
    rule: Rule,
    logits: torch.Tensor,  # [B, W, V] raw target logits judging the proposals
    proposals: torch.Tensor,  # [B, W] long
    alive: torch.Tensor,  # [B, W] bool: p(proposal) > 0
    strict_ok: torch.Tensor,  # [B, W] bool
    top1: torch.Tensor | None = None,  # [B, W] long: logits' argmax, when known
) -> PositionFacts:
    """MARS's facts (paper, Algorithm 1): the target's logits z1 >= z2 at each position, the
    margin statistic r (z2 / z1, relaxable only where z1 > 0; or exp(z2 - z1)) that ``decide``
    compares with theta, and whether the proposal is the top-1 or top-2 token."""
    z1, z2, t1, t2 = top2(logits, top1)  # each [B, W]
    stat = margin_statistic(z1, z2, rule.margin)
    return PositionFacts({rule.margin: stat}, in_top2(proposals, t1, t2, alive), strict_ok)


def per_token_facts(
    rule: Rule,
    logits: torch.Tensor,  # [B, W, V]
    proposals: torch.Tensor,  # [B, W] long
    probs: torch.Tensor,  # [B, W, V] target probabilities (sampling law; T = 1 if greedy)
    strict_ok: torch.Tensor,  # [B, W] bool
    has: torch.Tensor,  # [B, W] bool
    regret_carry: torch.Tensor | None = None,  # [B] float64
) -> PositionFacts:
    """A per-token rule's facts at every position; the regret is summed along each row's
    positions, after ``regret_carry`` (positions without a proposal add nothing)."""
    f = draft_facts(logits, proposals, probs, rule.needs)
    if "regret" in f:
        r = torch.where(has, f["regret"], torch.zeros_like(f["regret"])).cumsum(dim=1)
        if regret_carry is not None:
            r = r + regret_carry.to(r.device).double().view(-1, 1)
        f["regret"] = r
    return PositionFacts({}, None, strict_ok, **f)


def guarded_decision(
    rule: Rule,
    facts: PositionFacts,  # [B, W] each
    valid: torch.Tensor,  # [B, W] bool: a proposal to judge
    guard: torch.Tensor | None = None,  # [B, W] bool
    relax_left: torch.Tensor | None = None,  # [B] long
) -> tuple[Decision, torch.Tensor | None]:
    """The rule's decision with the loop guard and the relaxation budget applied, and the
    refusals [B, W] bool (None without guard and budget): positions the rule alone would
    have relaxed that the guard or the budget judges strictly."""
    decision = decide(rule, facts)
    if not rule.relaxes or (guard is None and relax_left is None):
        return decision, None
    # Would-be relaxations (judged on their own) that the guard or the budget refuses.
    wants = decision.ok & decision.relaxable & ~facts.strict_ok & valid  # [B, W]
    guarded = torch.zeros_like(wants) if guard is None else guard.to(wants.device) & valid
    if relax_left is not None:  # (a relaxation the guard refuses spends no budget)
        guarded = guarded | over_budget(wants & ~guarded, relax_left.to(wants.device))
    facts.guarded = guarded
    return decide(rule, facts), wants & guarded


def verify_rows(
    drafts: torch.Tensor,  # [B, K] long
    logits: torch.Tensor,  # [B, K+1, V]
    draft_len: torch.Tensor,  # [B] long
    rule: Rule,
    sampling: Sequence[Any],  # per row: a SamplingParams (temperature, top_k, top_p)
    *,
    bonus: torch.Tensor | None = None,  # [B] long
    seeds: torch.Tensor | None = None,  # [B] long
    positions: torch.Tensor | None = None,  # [B] long
    guard: torch.Tensor | None = None,  # [B, K+1] bool: never relax here (the loop guard)
    relax_left: torch.Tensor | None = None,  # [B] long: each row's remaining relaxations
    regret_carry: torch.Tensor | None = None,  # [B] float64
    top1: torch.Tensor | None = None,  # [B, K+1] long: logits' argmax, when the caller has it
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
                      top_p=top_p, draft_len=sel(draft_len), bonus=sel(bonus),
                      seeds=None if temperature == 0.0 else sel(seeds),
                      positions=None if temperature == 0.0 else sel(positions),
                      guard=sel(guard), relax_left=sel(relax_left), regret_carry=sel(regret_carry),
                      top1=sel(top1))

    if len(groups) == 1:
        return one(None, keys[0])
    dev = drafts.device
    parts = {key: one(idx, key) for key, idx in groups.items()}
    first = next(iter(parts.values()))
    out = VerifyResult(torch.zeros(B, dtype=torch.long, device=dev),
                       torch.zeros(B, dtype=torch.long, device=dev),
                       torch.zeros(B, K + 1, dtype=torch.bool, device=dev),
                       torch.zeros(B, K + 1, dtype=torch.bool, device=dev),
                       torch.zeros(B, K + 1, device=dev),
                       torch.zeros(B, dtype=torch.bool, device=dev),
                       torch.zeros(B, K + 1, dtype=torch.bool, device=dev),
                       None if first.regret is None else torch.zeros(B, dtype=torch.float64, device=dev))
    for key, idx in groups.items():
        part = parts[key]
        ix = torch.tensor(idx, dtype=torch.long, device=dev)
        for name in ("num_accepted", "next_token", "relaxed", "relaxable", "statistic", "strict_ok"):
            getattr(out, name)[ix] = getattr(part, name)
        if part.refused is not None:
            out.refused[ix] = part.refused
        if out.regret is not None and part.regret is not None:
            out.regret[ix] = part.regret
    return out
