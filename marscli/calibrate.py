"""Calibration: measure the target's margins under strict verification and pick theta.

Collection runs the engine with strict verification and observes every step. The target has
scored all k drafts of a step in one forward pass, so at each **verified draft position** we
know the margin statistics, the draft's rank in the target (top-1, top-2, other), the target's
log-probabilities of its top-1, top-2 and the draft token, and whether strict verification
accepts the draft there on its own. From that, the length of any step under MARS at any theta
is replayed exactly (marscli.verify's own Rule.decide, applied to the recorded facts).

The trade-off curve and the policies work on the replay:

- relaxable share: verified draft positions whose statistic exceeds theta;
- tau (mean acceptance length): tokens emitted per step, correction/bonus included;
- relaxed share: relaxed acceptances per emitted token;
- nll_increase: target log-probability given up per emitted token, summed over relaxed
  acceptances of (log p1 - log p(draft)) (= log p1 - log p2 for a top-2 draft).

What the replay ignores: after a relaxed token the real run continues on another trajectory
(different later drafts and margins), and the adaptive draft length would change with the
higher acceptance. The estimate is per step, on the strict trajectory.

The loop guard (marscli.repetition) is part of the rule that is replayed: collection records
at each position whether the guard would refuse to relax the draft there (it completes an
n-gram already in the record's recent output), and the replay judges those positions
strictly, as generate will; the relaxation budget (--max-relaxed-share) is replayed per
record. The cost is the regret of each relaxed token on the strict trajectory (log p1 -
log p(draft)), a sum of non-negative terms: it cannot fall because text became repetitive,
as the target's NLL of a looping output does (tests/test_repetition.py builds such a loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marscli.config import GUARD_OFF, GuardConfig
from marscli.profiles import (
    POLICY_FIXED,
    POLICY_MAX_NLL,
    POLICY_RELAX_RATE,
    RANK_KEYS,
)

#: Default policy parameter: at most 0.02 nats of target log-probability given up per token.
DEFAULT_MAX_NLL_INCREASE = 0.02
#: Histogram bins over [0, 1] (both statistics live there; below 0 is counted apart).
HIST_BINS = 200
#: Candidate thresholds evaluated exactly by the max-nll-increase policy (subsampled beyond).
MAX_CANDIDATES = 4096
RANK_TOP1, RANK_TOP2, RANK_OTHER = 1, 2, 3
STATISTICS = ("logit-ratio", "prob-ratio")


# --------------------------------------------------------------------------- collection


class MarginCollector:
    """Engine observer (Engine.run(..., observer_for=...)): one row per verified draft
    position. The engine must verify strictly; every step's strict outcome is checked
    against the replay rule as it is recorded."""

    def __init__(self) -> None:
        self.step_k: list[int] = []
        self.step_n: list[int] = []
        self.step_emitted: list[int] = []
        self._rows: list[np.ndarray] = []  # per step: [k, len(_COLS)] float64
        self._tree_rows: list[np.ndarray] = []  # per tree step: [nodes, len(TREE_COLS)]
        self.max_tokens = 0  # the record's max tokens (a per-record collector's)
        # Merged collectors: the record of each step and each record's max tokens (for the
        # replay of the per-record relaxation budget).
        self.step_record: list[int] = []
        self.record_max_tokens: list[int] = []

    def __call__(self, obs) -> None:
        import torch

        from marscli.verify import (
            LOGIT_RATIO,
            PROB_RATIO,
            margin_statistic,
            sampling_probs,
            strict_sampling_accepts,
            top2,
        )

        if getattr(obs, "tree", None) is not None:
            self._tree_step(obs)
            return
        self.max_tokens = obs.sampling.max_tokens
        k = obs.drafts.shape[1]
        n = int(obs.result.num_accepted[0])
        self.step_k.append(k)
        self.step_n.append(n)
        self.step_emitted.append(obs.emitted)
        if k == 0:
            return
        d = obs.drafts[0]  # [k]
        logits_k = obs.logits[0, :k].float()  # [k, V]
        z1, z2, t1, t2 = top2(logits_k)
        s = obs.sampling
        if s.greedy:  # the quality estimate uses the model's own distribution (T = 1)
            p = torch.softmax(logits_k, dim=-1)
            strict_ok = d == t1
        else:
            p = sampling_probs(obs.logits[:, :k], s.temperature, s.top_k, s.top_p)[0]
            strict_ok = strict_sampling_accepts(obs.drafts, p.unsqueeze(0), obs.u_accept,
                                                obs.draft_probs)[0]
        logp = torch.log(p.double())
        rank = torch.where(d == t1, RANK_TOP1, torch.where(d == t2, RANK_TOP2, RANK_OTHER))
        guarded = (obs.guard[0].to(z1.device).double() if obs.guard is not None
                   else torch.zeros_like(z1, dtype=torch.float64))
        cols = torch.stack([
            margin_statistic(z1, z2, LOGIT_RATIO).double(),
            margin_statistic(z1, z2, PROB_RATIO).double(),
            z1.double(),
            rank.double(),
            logp.gather(1, t1.unsqueeze(1)).squeeze(1),
            logp.gather(1, t2.unsqueeze(1)).squeeze(1),
            logp.gather(1, d.unsqueeze(1)).squeeze(1),
            strict_ok.double(),
            guarded,
        ], dim=1)
        ok = strict_ok.tolist()
        replayed = ok.index(False) if False in ok else k
        if replayed != n:  # the replay rule must reproduce what the verifier did
            raise RuntimeError(f"calibration replay disagrees with strict verification: {replayed} != {n}")
        self._rows.append(cols.cpu().numpy())

    def _tree_step(self, obs) -> None:
        """A tree step (EAGLE-3 trees). For the replay, the step is laid out as a chain: the
        accepted path, then one rejected child of its last node (the target's top-1 among
        them, else its top-2, else the drafter's first), as MARS would try it first. Every
        node on the path and every sibling of a path node (children of the rows the path
        passed through, the last one included) also goes to tree_nodes."""
        import torch

        from marscli.tree import ROOT
        from marscli.verify import (
            LOGIT_RATIO,
            PROB_RATIO,
            margin_statistic,
            sampling_probs,
            top2,
        )

        tree, L, res, s = obs.tree, obs.tree_logits.float(), obs.result, obs.sampling
        self.max_tokens = s.max_tokens
        guard = obs.guard.tolist() if obs.guard is not None else [False] * len(tree)
        path = [int(i) for i in res.path]
        n = len(path)
        z1, z2, t1, t2 = top2(L)  # [N+1] each
        stat_l = margin_statistic(z1, z2, LOGIT_RATIO).double()
        stat_p = margin_statistic(z1, z2, PROB_RATIO).double()
        p = torch.softmax(L, -1) if s.greedy else sampling_probs(L, s.temperature, s.top_k, s.top_p)
        logp = torch.log(p.double())  # [N+1, V]
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        t1l, t2l = t1.tolist(), t2.tolist()

        def row(i: int) -> int:
            return 0 if parents[i] == ROOT else parents[i] + 1

        def cols(i: int, ok: float) -> list[float]:
            r, d = row(i), tokens[i]
            rank = RANK_TOP1 if d == t1l[r] else RANK_TOP2 if d == t2l[r] else RANK_OTHER
            return [float(stat_l[r]), float(stat_p[r]), float(z1[r]), rank, float(logp[r, t1l[r]]),
                    float(logp[r, t2l[r]]), float(logp[r, d]), ok, float(guard[i])]

        if s.greedy and any(tokens[i] != t1l[row(i)] for i in path):
            raise RuntimeError("calibration replay disagrees with strict tree verification: "
                               "an accepted node is not the target's top-1")
        kids = tree.child_lists()
        last = 0 if not path else path[-1] + 1
        chain = [cols(i, 1.0) for i in path]
        rejected = kids[last]
        if rejected:
            pick = next((c for c in rejected if tokens[c] == t1l[last]), None)
            if pick is None:
                pick = next((c for c in rejected if tokens[c] == t2l[last]), rejected[0])
            chain.append(cols(pick, 0.0))
        self.step_k.append(len(chain))
        self.step_n.append(n)
        self.step_emitted.append(obs.emitted)
        if chain:
            self._rows.append(np.asarray(chain, dtype=np.float64))
        on_path = set(path)
        step = len(self.step_k) - 1
        nodes = []
        for depth, r in enumerate([0] + [i + 1 for i in path], start=1):
            for c in kids[r]:
                nodes.append(cols(c, 1.0 if c in on_path else 0.0) + [step, depth, float(c in on_path)])
        if nodes:
            self._tree_rows.append(np.asarray(nodes, dtype=np.float64))

    def extend(self, other: MarginCollector) -> None:
        """Append another collector's steps after this one's (batched calibration collects
        per record and merges in input order, so the data do not depend on the batch). Each
        collector appended is one record."""
        self.step_record += [len(self.record_max_tokens)] * len(other.step_k)
        self.record_max_tokens.append(other.max_tokens)
        self.step_k += other.step_k
        self.step_n += other.step_n
        self.step_emitted += other.step_emitted
        base = len(self.step_k) - len(other.step_k)
        for t in other._tree_rows:  # step numbers continue after this collector's
            t = t.copy()
            t[:, len(_COLS)] += base
            self._tree_rows.append(t)
        self._rows += other._rows

    def data(self, records: int, failed: int = 0, guard: GuardConfig = GUARD_OFF) -> MarginData:
        """The collected arrays; ``guard``: the loop guard the replay applies (the guard's
        verdicts were recorded with the engine's n-gram size and window)."""
        rows = np.concatenate(self._rows) if self._rows else np.zeros((0, len(_COLS)))
        tree = np.concatenate(self._tree_rows) if self._tree_rows else np.zeros((0, len(TREE_COLS)))
        if self.record_max_tokens:
            step_record, record_max = self.step_record, self.record_max_tokens
        else:  # one collector, not merged: one record
            step_record, record_max = [0] * len(self.step_k), [self.max_tokens]
        return MarginData(
            step_record=np.asarray(step_record, dtype=np.int64),
            record_max_tokens=np.asarray(record_max, dtype=np.int64),
            guard=guard,
            tree_nodes=tree,
            step_k=np.asarray(self.step_k, dtype=np.int64),
            step_n=np.asarray(self.step_n, dtype=np.int64),
            tokens=int(sum(self.step_emitted)),
            records=records,
            failed_records=failed,
            **{name: rows[:, i].copy() for i, name in enumerate(_COLS)},
        )


_COLS = ("logit_ratio", "prob_ratio", "z1", "rank", "logp1", "logp2", "logp_draft", "strict_ok",
         "guarded")
#: Columns of MarginData.tree_nodes: those of a position (strict_ok: accepted), then the step
#: number, the node's depth and whether it is on the accepted path.
TREE_COLS = _COLS + ("step", "depth", "on_path")


def _offset_steps(tree_nodes: np.ndarray, by: int) -> np.ndarray:
    out = tree_nodes.copy()
    out[:, len(_COLS)] += by
    return out


@dataclass
class MarginData:
    """Everything calibration recorded, as flat arrays (positions in step order)."""

    step_k: np.ndarray  # [S] drafts verified per step
    step_n: np.ndarray  # [S] drafts accepted per step (strict)
    tokens: int  # completion tokens emitted in the collection run
    records: int
    failed_records: int
    logit_ratio: np.ndarray  # [P] one entry per verified draft position
    prob_ratio: np.ndarray  # [P]
    z1: np.ndarray  # [P]
    rank: np.ndarray  # [P] 1, 2 or 3 (other)
    logp1: np.ndarray  # [P] target log-probabilities (sampling temperature; 1 when greedy)
    logp2: np.ndarray  # [P]
    logp_draft: np.ndarray  # [P]
    strict_ok: np.ndarray  # [P] 1.0 where strict verification accepts the draft on its own
    guarded: np.ndarray | None = None  # [P] 1.0 where the loop guard refuses to relax the draft
    step_record: np.ndarray | None = None  # [S] the record of each step (0..R-1)
    record_max_tokens: np.ndarray | None = None  # [R] each record's max tokens (its budget's base)
    guard: GuardConfig = GUARD_OFF  # the guard the replay applies
    # Tree steps only: one row per node on the accepted path or beside it ([T, len(TREE_COLS)]).
    tree_nodes: np.ndarray = field(default_factory=lambda: np.zeros((0, len(TREE_COLS))))
    _grid: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Data without a guard (built by hand): nothing guarded, one record, no budget base.
        if self.guarded is None:
            self.guarded = np.zeros(len(self.rank))
        if self.step_record is None:
            self.step_record = np.zeros(len(self.step_k), dtype=np.int64)
        if self.record_max_tokens is None:
            self.record_max_tokens = np.asarray([self.tokens], dtype=np.int64)

    @property
    def steps(self) -> int:
        return len(self.step_k)

    @property
    def positions(self) -> int:
        return len(self.rank)

    def statistic(self, margin: str) -> np.ndarray:
        if margin not in STATISTICS:
            raise ValueError(f"unknown margin statistic {margin!r}")
        return self.logit_ratio if margin == "logit-ratio" else self.prob_ratio

    @classmethod
    def merge(cls, parts: list[MarginData]) -> MarginData:
        """One MarginData from several (e.g. one per process): concatenated in order."""
        offsets = np.cumsum([0] + [len(p.record_max_tokens) for p in parts])
        return cls(
            step_record=np.concatenate([p.step_record + o for p, o in zip(parts, offsets)])
            if parts else np.zeros(0, dtype=np.int64),
            record_max_tokens=np.concatenate([p.record_max_tokens for p in parts])
            if parts else np.zeros(0, dtype=np.int64),
            guard=parts[0].guard if parts else GUARD_OFF,
            step_k=np.concatenate([p.step_k for p in parts]),
            step_n=np.concatenate([p.step_n for p in parts]),
            tokens=sum(p.tokens for p in parts),
            records=sum(p.records for p in parts),
            failed_records=sum(p.failed_records for p in parts),
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in _COLS},
            tree_nodes=np.concatenate([_offset_steps(p.tree_nodes, sum(q.steps for q in parts[:i]))
                                       for i, p in enumerate(parts)]) if parts else
            np.zeros((0, len(TREE_COLS))),
        )

    # ------------------------------------------------------------------ replay

    def _matrices(self, margin: str) -> dict[str, np.ndarray]:
        """Positions laid out as [S, Kmax] matrices (cached per statistic)."""
        if margin in self._grid:
            return self._grid[margin]
        S = self.steps
        K = int(self.step_k.max()) if S else 0
        valid = np.arange(K)[None, :] < self.step_k[:, None]  # [S, K]
        def lay(values: np.ndarray, fill: float) -> np.ndarray:
            m = np.full((S, K), fill, dtype=np.float64)
            m[valid] = values  # row-major order == step order, then position order
            return m
        gain = np.where(self.rank == RANK_TOP1, 0.0, self.logp1 - self.logp_draft)
        g = {
            "valid": valid,
            "stat": lay(self.statistic(margin), -math.inf),
            "strict_ok": lay(self.strict_ok, 0.0) > 0.5,
            "guarded": lay(self.guarded, 0.0) > 0.5,
            # The facts' in_top2: the draft is the target's top-1/top-2 with p > 0.
            "eligible": lay(((self.rank <= RANK_TOP2) & np.isfinite(self.logp_draft)).astype(float), 0.0) > 0.5,
            "gain": lay(gain, 0.0),
        }
        self._grid[margin] = g
        return g

    def replay(self, theta: float, margin: str) -> Replay:
        """Every step of the collection run, verified by MARS at ``theta`` (with the data's
        loop guard and relaxation budget) instead."""
        from marscli.verify import (
            MARS,
            PositionFacts,
            Rule,
            relaxed_positions,
        )

        g = self._matrices(margin)
        S, P = self.steps, self.positions
        rule = Rule(MARS, theta, margin)
        # The verifier's own per-position decision, on the recorded facts.
        facts = PositionFacts({margin: g["stat"]}, g["eligible"], g["strict_ok"],
                              g["guarded"] if self.guard.repeat_ngram else None)
        decision = rule.decide(facts)
        if self.guard.budgeted and rule.relaxes and S:
            facts.guarded = self._budget_guard(decision, g) | (
                False if facts.guarded is None else facts.guarded)
            decision = rule.decide(facts)
        relaxable = g["valid"] & decision.relaxable
        ok = decision.ok & g["valid"]
        n = np.cumprod(ok, axis=1).sum(axis=1) if ok.size else np.zeros(S, dtype=np.int64)
        accepted = np.arange(ok.shape[1])[None, :] < n[:, None]
        relaxed = relaxed_positions(accepted, relaxable, g["strict_ok"])
        emitted = int(n.sum()) + S
        return Replay(
            theta=theta,
            num_accepted=n,
            relaxable_share=float(relaxable.sum() / P) if P else 0.0,
            relaxed=int(relaxed.sum()),
            emitted=emitted,
            tau=emitted / S if S else 0.0,
            nll_increase=float(g["gain"][relaxed].sum() / emitted) if emitted else 0.0,
        )


    def _budget_guard(self, decision, g) -> np.ndarray:
        """[S, K] bool: positions reached after the record's relaxation budget is spent, as
        the verifier's ``over_budget`` finds them step by step. Up to the step that spends it,
        a record's steps are those of the replay without a budget, so the relaxations made
        before each step are min(unbudgeted count so far, budget)."""
        from marscli.verify import over_budget

        wants = decision.ok & decision.relaxable & ~g["strict_ok"] & g["valid"]  # [S, K]
        ok = decision.ok & g["valid"]
        n = np.cumprod(ok, axis=1).sum(axis=1) if ok.size else np.zeros(len(ok), dtype=np.int64)
        made = (wants & (np.arange(ok.shape[1])[None, :] < n[:, None])).sum(axis=1)  # [S]
        before = np.cumsum(made) - made  # relaxations before each step, over all records
        first = np.r_[True, self.step_record[1:] != self.step_record[:-1]]
        before = before - np.maximum.accumulate(np.where(first, before, 0))  # within its record
        budget = np.floor(self.guard.max_relaxed_share * self.record_max_tokens[self.step_record] + 1e-9)
        left = (budget - np.minimum(before, budget)).astype(np.int64)  # [S]
        return over_budget(wants, left)


@dataclass
class Replay:
    theta: float
    num_accepted: np.ndarray  # [S]
    relaxable_share: float
    relaxed: int
    emitted: int
    tau: float
    nll_increase: float  # nats per emitted token

    @property
    def relaxed_share(self) -> float:
        return self.relaxed / self.emitted if self.emitted else 0.0

    def row(self) -> dict[str, float]:
        return {
            "theta": self.theta,
            "relaxable_share": _r(self.relaxable_share),
            "relaxed_share": _r(self.relaxed_share),
            "tau": _r(self.tau),
            "nll_increase": _r(self.nll_increase),
        }


def _r(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")


# --------------------------------------------------------------------------- policies


def _sensitive_candidates(data: MarginData, margin: str) -> np.ndarray:
    """Distinct statistic values, highest first, at positions where relaxing changes the
    outcome (MARS and strict disagree there): the cost and tau only change at these."""
    stat = data.statistic(margin)
    eligible = (data.rank <= RANK_TOP2) & np.isfinite(data.logp_draft)
    sensitive = eligible != (data.strict_ok > 0.5)
    vals = np.unique(stat[sensitive & np.isfinite(stat)])[::-1]
    if len(vals) > MAX_CANDIDATES:
        idx = np.unique(np.linspace(0, len(vals) - 1, MAX_CANDIDATES).round().astype(int))
        vals = vals[idx]
    return vals


def _just_below(x: float) -> float:
    return float(np.nextafter(x, -math.inf))


def pick_max_nll_increase(data: MarginData, margin: str, eps: float) -> float:
    """The most relaxing theta whose estimated cost stays within eps nats per token.

    Walks down from strict through the thresholds where the replay changes and stops before
    the first one whose cost exceeds eps, so every theta above the chosen one is within eps
    too. (The total cost only grows as theta falls, but the cost per token need not: a relaxed
    token can unlock a run of exact acceptances.) Positions relax only when their statistic
    exceeds theta, so theta = c excludes c itself.
    """
    cands = _sensitive_candidates(data, margin)
    if len(cands) == 0:
        return 1.0  # nothing on record where relaxing would change anything
    best = float(cands[0])  # relaxes none of the sensitive positions: cost 0
    for c in cands[1:]:
        if data.replay(float(c), margin).nll_increase > eps:
            return best
        best = float(c)
    below = _just_below(best)
    return below if data.replay(below, margin).nll_increase <= eps else best


def pick_relax_rate(data: MarginData, margin: str, rate: float) -> float:
    """The lowest theta at which at most a share ``rate`` of verified positions is relaxable."""
    stat = np.sort(data.statistic(margin))[::-1]
    P = len(stat)
    finite = stat[np.isfinite(stat)]
    if P == 0 or len(finite) == 0:
        return 1.0
    m = int(math.floor(rate * P + 1e-9))
    if m >= len(finite):  # every position that can be relaxed, is
        return _just_below(float(finite[-1]))
    return float(stat[m])


#: Chosen thresholds are rounded up (towards strict) to this many decimals when the policy's
#: promise still holds: 0.9617 reads better than 0.9616848826408386 and is as good a choice.
THETA_DECIMALS = 4


def choose_theta(data: MarginData, margin: str, policy: str, value: float) -> float:
    if policy == POLICY_FIXED:
        return float(value)
    if policy == POLICY_MAX_NLL:
        theta = pick_max_nll_increase(data, margin, value)
        keeps = lambda t: data.replay(t, margin).nll_increase <= value
    elif policy == POLICY_RELAX_RATE:
        theta = pick_relax_rate(data, margin, value)
        keeps = lambda t: data.replay(t, margin).relaxable_share <= value
    else:
        raise ValueError(f"unknown policy {policy!r}")
    scale = 10 ** THETA_DECIMALS
    rounded = math.ceil(theta * scale) / scale
    return rounded if keeps(rounded) else theta


# --------------------------------------------------------------------------- curve, histogram

_FIXED_GRID = (0.5, 0.8, 0.85, 0.9, 0.95, 0.98, 0.99)
_QUANTILES = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98)


def curve_thetas(data: MarginData, margin: str, extra: tuple[float, ...] = ()) -> list[float]:
    """A theta grid dense where the data are (quantiles of the statistic) plus round values."""
    stat = data.statistic(margin)
    finite = stat[np.isfinite(stat)]
    qs = [round(float(q), 4) for q in np.quantile(finite, _QUANTILES)] if len(finite) else []
    return sorted(set(qs) | set(_FIXED_GRID) | {float(x) for x in extra})


def trade_off_curve(data: MarginData, margin: str, thetas: list[float]) -> list[dict[str, float]]:
    """One row per theta, and a last row for strict verification (theta = +inf)."""
    return [data.replay(t, margin).row() for t in thetas] + [data.replay(math.inf, margin).row()]


def histogram(data: MarginData, margin: str, bins: int = HIST_BINS) -> dict[str, Any]:
    """Counts of the statistic by draft rank over [0, 1]; values below 0 (and -inf) apart."""
    stat = data.statistic(margin)
    edges = np.linspace(0.0, 1.0, bins + 1)
    counts, below = {}, {}
    for key, sel in zip(RANK_KEYS, (data.rank == RANK_TOP1, data.rank == RANK_TOP2, data.rank == RANK_OTHER)):
        v = stat[sel]
        below[key] = int((v < 0).sum())
        c, _ = np.histogram(np.clip(v[v >= 0], 0.0, 1.0), bins=edges)
        counts[key] = [int(x) for x in c]
    return {
        "statistic": margin,
        "edges": [round(float(e), 6) for e in edges],
        "below": below,
        "counts": counts,
    }


# --------------------------------------------------------------------------- the result


@dataclass
class Calibration:
    """What calibrate decided and why: the figures a profile records."""

    margin: str
    policy: str
    policy_value: float
    theta: float
    summary: dict[str, float]
    histogram: dict[str, Any]
    curve: list[dict[str, float]]


def analyse(data: MarginData, margin: str, policy: str, value: float,
            seconds: float) -> Calibration:
    theta = choose_theta(data, margin, policy, value)
    at = data.replay(theta, margin)
    strict = data.replay(math.inf, margin)
    measured_tau = data.tokens / data.steps if data.steps else 0.0
    summary = {
        "relaxable_share": _r(at.relaxable_share),
        "relaxed_share": _r(at.relaxed_share),
        "tau_strict": _r(strict.tau),
        "tau_mars": _r(at.tau),
        "nll_increase": _r(at.nll_increase),
        "measured_tau_strict": _r(measured_tau),
        "measured_tokens_per_s": _r(data.tokens / seconds if seconds > 0 else 0.0),
    }
    curve = trade_off_curve(data, margin, curve_thetas(data, margin, (theta,)))
    return Calibration(margin, policy, float(value), theta, summary, histogram(data, margin), curve)
