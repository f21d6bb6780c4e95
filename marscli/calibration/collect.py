"""Calibration's collection: what the target says at every verified draft position of a
strict run, and the exact replay of that run under any rule (the policies that pick a rule's
knob from the replay: marscli.calibration.policies).

Collection runs the engine with strict verification and observes every step. The target has
scored all k drafts of a step in one forward pass, and the engine (``calibrating``) proposes
the position after them too, as it does for a relaxed rule; so at each **judged position**
(each draft, and the proposal after the drafts) we know the margin statistics, the
proposal's rank in the target (top-1, top-2, other), the target's log-probabilities of its
top-1, top-2 and the proposal, and whether it is the target's own token there (greedy: the
top-1; sampling: the position's draw). From that, the length of any step under MARS at any
theta is replayed exactly (the verifier's own rules.decide, applied to the recorded facts),
and every output position's proposal is judged as generate judges it.

The trade-off curve and the policies work on the replay:

- relaxable share: verified draft positions whose statistic exceeds theta;
- tau (mean acceptance length): tokens emitted per step, correction/bonus included;
- relaxed share: relaxed acceptances per emitted token;
- nll_increase: target log-probability given up per emitted token, summed over relaxed
  acceptances of (log p1 - log p(draft)) (= log p1 - log p2 for a top-2 draft).

What the replay ignores: after a relaxed token the real run continues on another trajectory
(different later drafts and margins), and the adaptive draft length would change with the
higher acceptance. The estimate is per step, on the strict trajectory.

The loop guard (marscli.verification.guard) is part of the rule that is replayed: collection records
at each position whether the guard would refuse to relax the draft there (it completes an
n-gram already in the record's recent output), and the replay judges those positions
strictly, as generate will; the relaxation budget (--max-relaxed-share) is replayed per
record. The cost is the regret of each relaxed token on the strict trajectory (log p1 -
log p(draft)), a sum of non-negative terms: it cannot fall because text became repetitive,
as the target's NLL of a looping output does (tests/verification/test_repetition.py builds such a loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from marscli.config import GUARD_OFF, SPANS_OFF, GuardConfig, SpanConfig
from marscli.verification import rules
from marscli.verification.chain import sampling_probs
from marscli.verification.registry import (
    GREEDY_MODE,
    LOGIT_RATIO,
    MARGINS,
    MARS,
    PROB_RATIO,
    SAMPLING_MODE,
    TYPICAL,
    Rule,
)
from marscli.verification.tree import ROOT

RANK_TOP1, RANK_TOP2, RANK_OTHER = 1, 2, 3


# --------------------------------------------------------------------------- collection


class MarginCollector:
    """Engine observer (Engine.run(..., observer_for=...)): one row per verified draft
    position. The engine must verify strictly; every step's strict outcome is checked
    against the replay rule as it is recorded."""

    def __init__(self) -> None:
        self.step_k: list[int] = []
        self.step_bonus: list[int] = []  # 1: the step judged a proposal after its drafts
        self.step_n: list[int] = []
        self.step_emitted: list[int] = []
        self._rows: list[np.ndarray] = []  # per step: [k, len(_COLS)] float64
        self._tree_rows: list[np.ndarray] = []  # per tree step: [nodes, len(TREE_COLS)]
        self.max_tokens = 0  # the record's max tokens (a per-record collector's)
        # Merged collectors: the record of each step and each record's max tokens (for the
        # replay of the per-record relaxation budget).
        self.step_record: list[int] = []
        self.record_max_tokens: list[int] = []
        self.sampled = False  # some step sampled (regret, greedy only, cannot be replayed)

    def __call__(self, obs) -> None:
        import torch

        self.sampled = self.sampled or not obs.sampling.greedy
        if getattr(obs, "tree", None) is not None:
            self._tree_step(obs)
            return
        self.max_tokens = obs.sampling.max_tokens
        k = obs.drafts.shape[1]
        n = int(obs.result.num_accepted[0])
        bonus = obs.next_proposal is not None
        P = k + bonus  # judged positions: the drafts, then the proposal after them
        self.step_k.append(k)
        self.step_bonus.append(int(bonus))
        self.step_n.append(n)
        self.step_emitted.append(obs.emitted)
        if P == 0:
            return
        d = obs.drafts[0]  # [k]
        if bonus:
            d = torch.cat([d, torch.tensor([obs.next_proposal], dtype=torch.long, device=d.device)])
        logits_k = obs.logits[0, :P].float()  # [P, V]
        z1, z2, t1, t2 = rules.top2(logits_k)
        s = obs.sampling
        # the verifier's own verdict: the proposal is the target's token (top-1, or the draw)
        strict_ok = obs.result.strict_ok[0, :P].to(d.device)
        if s.greedy:  # the quality estimate uses the model's own distribution (T = 1)
            p = torch.softmax(logits_k, dim=-1)
        else:
            p = sampling_probs(obs.logits[:, :P], s.temperature, s.top_k, s.top_p)[0]
        logp = torch.log(p.double())
        rank = torch.where(d == t1, RANK_TOP1, torch.where(d == t2, RANK_TOP2, RANK_OTHER))
        guarded = (obs.guard[0, :P].to(z1.device).double() if obs.guard is not None
                   else torch.zeros_like(z1, dtype=torch.float64))
        cols = torch.stack([
            rules.margin_statistic(z1, z2, LOGIT_RATIO).double(),
            rules.margin_statistic(z1, z2, PROB_RATIO).double(),
            z1.double(),
            rank.double(),
            logp.gather(1, t1.unsqueeze(1)).squeeze(1),
            logp.gather(1, t2.unsqueeze(1)).squeeze(1),
            logp.gather(1, d.unsqueeze(1)).squeeze(1),
            strict_ok.double(),
            guarded,
        ], dim=1)
        # The per-token rules' facts, by the verifier's own function on the verifier's own p
        # ([1, P, V], as verify builds them), so the replay compares the very same numbers.
        p_rows = (torch.softmax(obs.logits[:, :P].float(), dim=-1) if s.greedy
                  else sampling_probs(obs.logits[:, :P], s.temperature, s.top_k, s.top_p))
        facts = rules.draft_facts(obs.logits[:, :P], d.view(1, P), p_rows, ALL_FACTS)
        z_draft = obs.logits[:, :P].float().gather(-1, d.view(1, P, 1)).squeeze(-1)
        cols = torch.cat([cols, torch.stack([facts["p_draft"][0].double(), facts["p1"][0].double(),
                                             facts["rank"][0].double(), facts["entropy"][0].double(),
                                             z_draft[0].double(), facts["regret"][0].double()], dim=1)], dim=1)
        ok = strict_ok[:k].tolist()
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

        tree, L, res, s = obs.tree, obs.tree_logits.float(), obs.result, obs.sampling
        self.max_tokens = s.max_tokens
        guard = obs.guard.tolist() if obs.guard is not None else [False] * len(tree)
        path = [int(i) for i in res.path]
        n = len(path)
        z1, z2, t1, t2 = rules.top2(L)  # [N+1] each
        stat_l = rules.margin_statistic(z1, z2, LOGIT_RATIO).double()
        stat_p = rules.margin_statistic(z1, z2, PROB_RATIO).double()
        p = torch.softmax(L, -1) if s.greedy else sampling_probs(L, s.temperature, s.top_k, s.top_p)
        logp = torch.log(p.double())  # [N+1, V]
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        t1l, t2l = t1.tolist(), t2.tolist()
        # Per node, at its parent's row, as verify_tree's per-token facts (own regret only:
        # the replay sums it along the chain laid out below, which is a root path).
        rows = tree.parents.to(L.device) + 1  # [N]
        tok = tree.tokens.to(L.device)
        nf = rules.draft_facts(L[rows], tok, p[rows], ALL_FACTS) if len(tree) else {}
        extra = (torch.stack([nf["p_draft"].double(), nf["p1"].double(), nf["rank"].double(),
                              nf["entropy"].double(), L[rows].gather(1, tok.unsqueeze(1)).squeeze(1).double(),
                              nf["regret"].double()], dim=1).tolist() if len(tree) else [])

        def row(i: int) -> int:
            return 0 if parents[i] == ROOT else parents[i] + 1

        def cols(i: int, ok: float) -> list[float]:
            r, d = row(i), tokens[i]
            rank = RANK_TOP1 if d == t1l[r] else RANK_TOP2 if d == t2l[r] else RANK_OTHER
            return [float(stat_l[r]), float(stat_p[r]), float(z1[r]), rank, float(logp[r, t1l[r]]),
                    float(logp[r, t2l[r]]), float(logp[r, d]), ok, float(guard[i])] + extra[i]

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
        self.step_bonus.append(0)
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
        self.sampled = self.sampled or other.sampled
        self.step_record += [len(self.record_max_tokens)] * len(other.step_k)
        self.record_max_tokens.append(other.max_tokens)
        self.step_k += other.step_k
        self.step_bonus += other.step_bonus
        self.step_n += other.step_n
        self.step_emitted += other.step_emitted
        base = len(self.step_k) - len(other.step_k)
        for t in other._tree_rows:  # step numbers continue after this collector's
            t = t.copy()
            t[:, len(_COLS)] += base
            self._tree_rows.append(t)
        self._rows += other._rows

    def data(self, records: int, failed: int = 0, guard: GuardConfig = GUARD_OFF,
             spans: SpanConfig = SPANS_OFF) -> MarginData:
        """The collected arrays; ``guard``: the loop guard the replay applies (the guard's
        verdicts were recorded with the engine's n-gram size and window); ``spans``: the
        strict spans the engine tracked."""
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
            spans=spans,
            tree_nodes=tree,
            step_k=np.asarray(self.step_k, dtype=np.int64),
            step_bonus=np.asarray(self.step_bonus, dtype=np.int64),
            step_n=np.asarray(self.step_n, dtype=np.int64),
            tokens=int(sum(self.step_emitted)),
            records=records,
            failed_records=failed,
            sampled=self.sampled,
            **{name: rows[:, i].copy() for i, name in enumerate(_COLS)},
        )


_COLS = ("logit_ratio", "prob_ratio", "z1", "rank", "logp1", "logp2", "logp_draft", "strict_ok",
         "guarded", "p_draft", "p1", "target_rank", "entropy", "z_draft", "regret")
#: Every per-token fact a rule may need (Rule.needs), recorded at every position.
ALL_FACTS = frozenset({"p_draft", "p1", "rank", "entropy", "regret"})
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
    logit_ratio: np.ndarray  # [P] one entry per judged position (a step's drafts, then its bonus proposal)
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
    #: Strict spans the collection tracked: their positions are in ``guarded`` (the engine
    #: folds them into the guard it records), so the replay applies it with spans too.
    spans: SpanConfig = SPANS_OFF
    # Tree steps only: one row per node on the accepted path or beside it ([T, len(TREE_COLS)]).
    tree_nodes: np.ndarray = field(default_factory=lambda: np.zeros((0, len(TREE_COLS))))
    # The per-token rules' facts (rules.PositionFacts), as the verifier computes them:
    p_draft: np.ndarray | None = None  # [P] p(draft) (float32 in the verifier)
    p1: np.ndarray | None = None  # [P] the top probability
    target_rank: np.ndarray | None = None  # [P] 1 + number of tokens with a larger logit
    entropy: np.ndarray | None = None  # [P] H(p) in nats (nan: not recorded)
    z_draft: np.ndarray | None = None  # [P] the draft's raw logit
    regret: np.ndarray | None = None  # [P] the draft's own regret z1 - z(draft) (not summed)
    sampled: bool = False  # some step sampled (greedy-only rules cannot be replayed on it)
    #: [S] 1 where the step judged a proposal after its drafts (its last position); None: none
    step_bonus: np.ndarray | None = None
    _grid: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Data without a guard (built by hand): nothing guarded, one record, no budget base.
        if self.guarded is None:
            self.guarded = np.zeros(len(self.rank))
        # Hand-made data without the per-token facts: what follows from the columns there
        # (at T = 1, log p1 - log p(x) = z1 - z(x)); ranks beyond 2 are only known to be >= 3;
        # the entropy is unknown (the typical rule refuses to replay without it).
        if self.p_draft is None:
            self.p_draft = np.exp(self.logp_draft)
        if self.p1 is None:
            self.p1 = np.exp(self.logp1)
        if self.target_rank is None:
            self.target_rank = np.asarray(self.rank, dtype=np.float64).copy()
        if self.entropy is None:
            self.entropy = np.full(len(self.rank), math.nan)
        if self.regret is None:
            self.regret = np.where(self.rank == RANK_TOP1, 0.0, self.logp1 - self.logp_draft)
        if self.z_draft is None:
            self.z_draft = self.z1 - self.regret
        if self.step_record is None:
            self.step_record = np.zeros(len(self.step_k), dtype=np.int64)
        if self.step_bonus is None:
            self.step_bonus = np.zeros(len(self.step_k), dtype=np.int64)
        if self.record_max_tokens is None:
            self.record_max_tokens = np.asarray([self.tokens], dtype=np.int64)

    @property
    def steps(self) -> int:
        return len(self.step_k)

    @property
    def positions(self) -> int:
        return len(self.rank)

    @property
    def in_top2(self) -> np.ndarray:
        """[P] bool: the draft is the target's top-1 or top-2 token with p > 0 (rules.in_top2)."""
        return (self.rank <= RANK_TOP2) & np.isfinite(self.logp_draft)

    def statistic(self, margin: str) -> np.ndarray:
        if margin not in MARGINS:
            raise ValueError(f"unknown margin statistic {margin!r}")
        return self.logit_ratio if margin == LOGIT_RATIO else self.prob_ratio

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
            spans=parts[0].spans if parts else SPANS_OFF,
            step_k=np.concatenate([p.step_k for p in parts]),
            step_bonus=np.concatenate([p.step_bonus for p in parts]),
            step_n=np.concatenate([p.step_n for p in parts]),
            tokens=sum(p.tokens for p in parts),
            sampled=any(p.sampled for p in parts),
            records=sum(p.records for p in parts),
            failed_records=sum(p.failed_records for p in parts),
            **{name: np.concatenate([getattr(p, name) for p in parts]) for name in _COLS},
            tree_nodes=np.concatenate([_offset_steps(p.tree_nodes, sum(q.steps for q in parts[:i]))
                                       for i, p in enumerate(parts)]) if parts else
            np.zeros((0, len(TREE_COLS))),
        )

    # ------------------------------------------------------------------ replay

    def grid(self, margin: str | None = None) -> dict[str, np.ndarray]:
        """Positions laid out as [S, Kmax] matrices (cached; ``stat:<margin>`` on demand)."""
        g = self._grid
        if not g:
            S = self.steps
            width = self.step_k + self.step_bonus  # judged positions per step
            K = int(width.max()) if S else 0
            valid = np.arange(K)[None, :] < width[:, None]  # [S, K]

            def lay(values: np.ndarray, fill: float) -> np.ndarray:
                m = np.full((S, K), fill, dtype=np.float64)
                m[valid] = values  # row-major order == step order, then position order
                return m
            g.update(
                lay=lay,
                valid=valid,
                strict_ok=lay(self.strict_ok, 0.0) > 0.5,
                guarded=lay(self.guarded, 0.0) > 0.5,
                # The facts' in_top2: the draft is the target's top-1/top-2 with p > 0.
                eligible=lay(self.in_top2.astype(float), 0.0) > 0.5,
                gain=lay(np.where(self.rank == RANK_TOP1, 0.0, self.logp1 - self.logp_draft), 0.0),
                p_draft=lay(self.p_draft, 0.0),
                p1=lay(self.p1, 1.0),
                rank=lay(self.target_rank, math.inf),
                entropy=lay(self.entropy, 0.0),
                # The step's summed regret so far, as chain.chain_facts sums it (padding: 0).
                regret=np.cumsum(lay(self.regret, 0.0), axis=1),
            )
        if margin is not None and f"stat:{margin}" not in g:
            g[f"stat:{margin}"] = g["lay"](self.statistic(margin), -math.inf)
        return g

    def facts(self, rule) -> Any:
        """The recorded facts as rules.PositionFacts of [S, Kmax] numpy arrays, for ``rule``
        (with the loop guard's verdicts when the data's guard is on)."""

        if self.sampled and SAMPLING_MODE not in rule.modes:
            raise ValueError(f"the {rule.name} rule is defined for {GREEDY_MODE} decoding only; "
                             "these margins were collected while sampling")
        g = self.grid(rule.margin if rule.name == MARS else None)
        if rule.name == TYPICAL and np.isnan(g["entropy"][g["valid"]]).any():
            raise ValueError("the typical rule needs the entropy at each position, which these "
                             "data lack (collect them again with this marscli)")
        guarded = g["guarded"] if self.guard.repeat_ngram or self.spans.active else None
        if rule.name == MARS:
            return rules.PositionFacts({rule.margin: g[f"stat:{rule.margin}"]}, g["eligible"], g["strict_ok"], guarded)
        return rules.PositionFacts({}, None, g["strict_ok"], guarded, p_draft=g["p_draft"], p1=g["p1"],
                             rank=g["rank"], entropy=g["entropy"], regret=g["regret"])

    def replay(self, rule: Any, margin: str | None = None) -> Replay:
        """Every step of the collection run, verified by ``rule`` (a Rule; or a theta
        and a margin: MARS there, strict at +inf) instead, with the data's loop guard and
        relaxation budget. Each position is judged by the verifier's own rules.decide."""

        if not isinstance(rule, Rule):
            rule = Rule(MARS, float(rule), margin or LOGIT_RATIO)
        g = self.grid()
        S, P = self.steps, self.positions
        facts = self.facts(rule)
        decision = rules.decide(rule, facts)
        if self.guard.budgeted and rule.relaxes and S:
            facts.guarded = self._budget_guard(decision, g) | (
                False if facts.guarded is None else facts.guarded)
            decision = rules.decide(rule, facts)
        relaxable = g["valid"] & decision.relaxable
        ok = (decision.ok | g["strict_ok"]) & g["valid"]
        # kept positions: the accepted drafts, and the bonus proposal when all drafts were
        n_kept = np.cumprod(ok, axis=1).sum(axis=1) if ok.size else np.zeros(S, dtype=np.int64)
        n = np.minimum(n_kept, self.step_k)
        accepted = np.arange(ok.shape[1])[None, :] < n_kept[:, None]
        relaxed = rules.relaxed_positions(accepted, relaxable, g["strict_ok"])
        relaxing = ok & relaxable & ~g["strict_ok"]  # accepted on their own only if relaxed
        emitted = int(n.sum()) + S
        knob = rule.knob or ("theta", math.inf)
        return Replay(
            theta=knob[1],
            num_accepted=n,
            relaxable_share=float(relaxable.sum() / P) if P else 0.0,
            relaxed=int(relaxed.sum()),
            emitted=emitted,
            tau=emitted / S if S else 0.0,
            nll_increase=float(g["gain"][relaxed].sum() / emitted) if emitted else 0.0,
            knob_name=knob[0],
            relax_rate=float(relaxing.sum() / P) if P else 0.0,
            relaxing=int(relaxing.sum()),
        )

    def _budget_guard(self, decision, g) -> np.ndarray:
        """[S, K] bool: positions reached after the record's relaxation budget is spent, as
        the verifier's ``over_budget`` finds them step by step. Up to the step that spends it,
        a record's steps are those of the replay without a budget, so the relaxations made
        before each step are min(unbudgeted count so far, budget)."""

        wants = decision.ok & decision.relaxable & ~g["strict_ok"] & g["valid"]  # [S, K]
        ok = (decision.ok | g["strict_ok"]) & g["valid"]
        n = np.cumprod(ok, axis=1).sum(axis=1) if ok.size else np.zeros(len(ok), dtype=np.int64)
        made = (wants & (np.arange(ok.shape[1])[None, :] < n[:, None])).sum(axis=1)  # [S]
        before = np.cumsum(made) - made  # relaxations before each step, over all records
        first = np.r_[True, self.step_record[1:] != self.step_record[:-1]]
        before = before - np.maximum.accumulate(np.where(first, before, 0))  # within its record
        budget = np.floor(self.guard.max_relaxed_share * self.record_max_tokens[self.step_record] + 1e-9)
        left = (budget - np.minimum(before, budget)).astype(np.int64)  # [S]
        return rules.over_budget(wants, left)


@dataclass
class Replay:
    theta: float  # the rule's main knob's value (named knob_name; theta for MARS)
    num_accepted: np.ndarray  # [S]
    relaxable_share: float  # positions where the rule relaxed the check (MARS: statistic > theta)
    relaxed: int
    emitted: int
    tau: float
    nll_increase: float  # nats per emitted token
    knob_name: str = "theta"
    #: The relax rate (every rule's common measure; bench --match-relax-rate matches it): the
    #: share of verified draft positions at which the rule, judging the position on its own
    #: (rules.decide, loop guard and budget applied), accepts a draft strict verification
    #: rejects there: decision.ok & decision.relaxable & ~strict_ok, over all positions.
    relax_rate: float = 0.0
    relaxing: int = 0  # the count behind relax_rate

    @property
    def relaxed_share(self) -> float:
        return self.relaxed / self.emitted if self.emitted else 0.0

    def row(self) -> dict[str, float]:
        return {
            self.knob_name: self.theta,
            "relaxable_share": significant(self.relaxable_share),
            "relax_rate": significant(self.relax_rate),
            "relaxed_share": significant(self.relaxed_share),
            "tau": significant(self.tau),
            "nll_increase": significant(self.nll_increase),
        }


def significant(x: float, digits: int = 6) -> float:
    return float(f"{x:.{digits}g}")
