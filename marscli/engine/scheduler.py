"""The scheduler: every record of a run decodes here, batch size 1 being a batch of one.

A step, for all active rows at once, reads like gpt-fast's loop (``Engine._chain_step``):

1. draft: every row's drafter offers what it could draft, the draft-length policy picks every
   row's k by the measured step costs (marscli.engine.lengths; 0 included: a plain step), and
   the drafters propose k drafts, and the proposal for the position after them where a
   relaxed rule judges it (``BatchedDrafter.propose``);
2. one forward: the target scores [pending, d_1 .. d_k] of every row over the shared cache;
3. verify: the rulebook judges every row's positions in ONE call
   (``marscli.verification.chain.verify_rows``) with the step's inputs
   (marscli.engine.step_inputs), and the verdicts come to the host in ONE transfer;
4. commit: each row commits its own tokens (``Sequence.commit``), its drafter learns, and the
   caches keep each row's accepted positions.

Every output token is defined from the record's own text (its drafter's proposal for that
position, the target's logits there, the position's draw), so a record's text never depends
on the draft lengths, the batch, its neighbours or measured timings: the steps only compute
it, and may follow the costs freely (docs/verification.md, "The reproducibility contract").

A tree step (``--tree-*``: an EAGLE-3 head's tree, or a draft model's chain with sibling
leaves; batch size 1) takes the same path with one tree forward and ``verify_tree``. Records
join, leave and restart after out-of-memory in ``marscli.engine.admission``. A row that asks
for logprobs gets them from the step's own logits (marscli.engine.logprobs), brought to the
host in the step's one transfer.

Results are yielded as rows finish, not in input order (marscli.io restores input order).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

import marscli.engine.logprobs as lp
from marscli.config import (
    GUARD_OFF,
    RELAX_AT,
    RELAX_EVERY,
    DraftConfig,
    GuardConfig,
    SamplingParams,
    SpanConfig,
)
from marscli.drafters.base import BatchedDrafter, Proposal, RowDrafters
from marscli.drafters.eagle3_head import FeatureTap
from marscli.drafters.kinds import EAGLE3, MODEL, NGRAM, NONE, drafter_kind
from marscli.engine.admission import Admission, Joiner
from marscli.engine.costs import static_costs
from marscli.engine.lengths import step_lengths
from marscli.engine.prompts import PromptEncoder
from marscli.engine.provenance import step_kinds
from marscli.engine.sequence import (
    GenerationResult,
    RowSettings,
    Sequence,
    StepObservation,
)
from marscli.engine.step_inputs import chain_inputs, tree_guard
from marscli.engine.tree_forward import check_tree_support, tree_block
from marscli.errors import UsageError
from marscli.models.fastpath import install_cpu_fastpath, install_folded_gqa_attention
from marscli.models.kvcache import ContiguousCache, sliding_layers, to_device
from marscli.models.prefill import DEFAULT_PREFIX_CACHE_MIB, MIB, Prefiller, PrefixCache
from marscli.models.slots import EAGER, SlotCache, StepPlan, graphs_blocker
from marscli.models.slots import supports as supports_slots
from marscli.verification.chain import verify_rows
from marscli.verification.registry import REGRET, Rule
from marscli.verification.spans import SpanRule
from marscli.verification.tree import DraftTree, verify_tree

Observer = Callable[[StepObservation], None]


@dataclass
class Row:
    """One active row of the batch: its record and its decoding state."""

    item: Any
    ids: list[int]
    sampling: SamplingParams
    seq: Sequence
    npos: int  # valid tokens in the cache (the whole committed sequence but the pending token)
    logprobs: list[lp.TokenLogprob] | None = None  # per emitted token, when the record asks


def step_plan(mode: str, device, model) -> StepPlan:
    """How an engine's steps run for --compile `mode` (config.COMPILE_MODES), decided once per
    engine (a StepPlan):

    - "graphs": static shapes replayed as CUDA graphs; on CUDA for auto and on;
    - "compiled": static shapes compiled by torch.compile (inductor); on a CPU for on only:
      auto stays eager there, because the compilations cost more than they save on a typical
      run (docs/engine.md, "The captured step");
    - "static" (an internal mode): the captured step's shapes, run eagerly (what tests check
      on a CPU);
    - "eager" otherwise, and for models a slot cache cannot hold (sliding windows, flash
      attention).

    Chain and tree steps alike; an EAGLE-3 head's target features are outputs of the step,
    and its own chain passes follow the step kind (marscli.drafters.eagle3_slots.HeadSlots)."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return EAGER
    if not supports_slots(model):
        return EAGER
    if mode == "static":
        return StepPlan("static")
    if device.type == "cuda":
        blocker = graphs_blocker(model)
        if blocker is not None:  # static shapes, eagerly: never a capture that cannot work
            _say_once(f"marscli: no CUDA graphs for this model ({blocker}); its steps run eagerly "
                      "at the captured step's shapes\n")
            return StepPlan("static")
        return StepPlan("graphs")
    return StepPlan("compiled")


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        sys.stderr.write(line)


class Engine:
    """Speculative generation for one target, one drafter and one verification rule.

    target: a LoadedModel (.model, .tokenizer, .device, .eos_token_ids, .context_length).
    drafters: the BatchedDrafter for the run (marscli.drafters.factory.build_drafters).
    costs: the measured step costs (marscli.engine.costs.StepCosts) the draft lengths are chosen
    by; None: the static curve for the target's device.
    prefix_cache_mib: the bound of the run's prefix cache (0: none; marscli.models.prefill).
    relax_at: RELAX_EVERY (default) or RELAX_DRAFTED (the paper's Algorithm 1: a fixed K).
    calibrating: a strict engine that collects for calibration: it drafts, and proposes
    after the drafts, as an engine of a relaxed rule would, so that calibration judges the
    very positions generate will (marscli.calibration.collect).
    """

    def __init__(self, target, drafters: BatchedDrafter, rule: Rule, draft_cfg: DraftConfig,
                 batch_size: int = 1, costs=None, guard: GuardConfig = GUARD_OFF,
                 spans: SpanConfig | None = None, prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
                 compile_mode: str = "auto", relax_at: str = RELAX_EVERY,
                 calibrating: bool = False, plan: StepPlan | None = None):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if relax_at not in RELAX_AT:
            raise ValueError(f"relax_at must be one of {RELAX_AT}, got {relax_at!r}")
        self.target = target
        self.model = target.model
        self.device = target.device
        self.drafters = drafters
        self.rule = rule
        self.batch_size = batch_size
        if costs is None:
            costs = static_costs(self.device.type)
        self.costs = costs
        self.adaptive = draft_cfg.adaptive
        self.drained = False  # no record waits for a row: draft lengths aim at the job's end
        self.relax_at = relax_at
        kind = drafter_kind(draft_cfg.kind)
        #: A relaxed rule judges the proposal after each step's drafts too: at every output
        #: position. Not where the chain's tokens are not the drafter's proposals for their
        #: positions (an EAGLE-3 head's, a tree's) or under Algorithm 1: those rows draft a
        #: fixed K instead (marscli.engine.lengths), their text a function of K.
        schedule_free = relax_at == RELAX_EVERY and draft_cfg.kind != EAGLE3 and drafters.tree is None
        relaxing = (rule.relaxes or calibrating) and kind.drafts
        self.bonus = relaxing and schedule_free
        # (calibration drafts a fixed K too: its steps, and so its profile, follow no batch)
        self.fixed_lengths = (relaxing and not schedule_free) or (calibrating and kind.drafts)
        #: draft positions a paid drafter runs beyond a step's drafts (its proposal after them)
        self.bonus_drafts = 1 if self.bonus and (draft_cfg.kind == MODEL or draft_cfg.hybrid) else 0
        #: the first output token from the prefill pass (``first_from_prefill``)
        self._first_ok = (draft_cfg.kind in (NONE, NGRAM) and not draft_cfg.hybrid and not calibrating
                          and not self.fixed_lengths and drafters.tree is None)
        self.prompts = PromptEncoder(target.tokenizer, target.context_length)
        k_max = draft_cfg.num_draft_tokens if drafter_kind(draft_cfg.kind).drafts else 0
        self.tree = drafters.tree
        if self.tree is not None:
            if batch_size > 1:
                raise ValueError("draft trees run one record at a time (batch size 1); "
                                 "use chain drafting to batch")
            try:
                check_tree_support(self.model)
            except ValueError as e:  # sliding windows, flash attention...: chain drafting still works
                raise UsageError(f"--tree-*: {e}") from None
            k_max = self.tree.max_path
        self.guard = guard
        self.spans = SpanRule.from_config(spans)  # None: no strict span
        self.settings = RowSettings(target.tokenizer, frozenset(int(t) for t in target.eos_token_ids),
                                    k_max, target.context_length, guard, rule.relaxes, self.spans,
                                    loop_rewind=guard.loop_rewind if self.bonus else 0)
        # A drafter that drafts from the target's hidden states (EAGLE-3) names the layers it
        # reads; every target forward pass then captures them (no second pass).
        self.tap = None
        if drafters.feature_layers:
            self.tap = FeatureTap(self.model, drafters.feature_layers)
        self.last_features: torch.Tensor | None = None  # [B, S, F] from the newest forward pass
        tok = target.tokenizer
        self.pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
        sliding = sliding_layers(self.model)
        if batch_size > 1 and sliding:
            raise ValueError(
                "batched decoding does not support models with sliding-window attention "
                f"layers (layers {sliding[:4]}...); use --batch-size 1")
        if self.device.type == "cpu":
            install_cpu_fastpath(self.model)
        elif self.device.type == "cuda":  # verification reads each shared K/V head once
            install_folded_gqa_attention(self.model)
        #: Rows keep their keys and values in a slot cache (marscli.models.slots) at every
        #: batch size; a model it cannot hold decodes one record at a time in a contiguous
        #: cache (marscli.models.kvcache.ContiguousCache).
        self.slots_fit = supports_slots(self.model)
        if batch_size > 1 and not self.slots_fit:
            raise ValueError(
                "batched decoding needs an attention that takes a custom mask (sdpa or eager); "
                f"this model uses {getattr(self.model.config, '_attn_implementation', None)!r}; "
                "use --batch-size 1")
        #: How a step's forward runs (a StepPlan: eager, static, graphs or compiled; step_plan
        #: says when), decided once: the drafters run their passes by it too.
        self.plan = plan if plan is not None else step_plan(compile_mode, self.device, self.model)
        self.drafters.use_plan(self.plan)
        self.oom_retries = 0  # how many times the batch was halved (for reports and tests)
        self.peak_cache_bytes = 0  # largest target KV cache seen (slot buffers, spare capacity included)
        self.prefill_seconds = 0.0  # time spent prefilling joining records
        # Sliding-window layers keep state of their own beside keys/values: no prefix reuse.
        self.prefix = PrefixCache(0 if sliding else int(prefix_cache_mib * MIB), features=self.tap is not None)
        self.prefiller = Prefiller(self.model, self.device, self.prefix, self.pad_id,
                                   features=lambda: self.last_features, packing=True)
        self.reset_rows()

    # ------------------------------------------------------------------ one record

    def generate_ids(self, prompt_ids: list[int], sampling: SamplingParams,
                     observer: Observer | None = None) -> GenerationResult:
        """One record alone; its failure raises. Consecutive calls are one job: the job corpus
        (``forget_earlier_records``) keeps the records of earlier calls."""
        for _, res in self.run([None], lambda _: (prompt_ids, sampling),
                               observer_for=(lambda _: observer) if observer else None, continue_job=True):
            if isinstance(res, BaseException):
                raise res
            return res
        raise AssertionError("run() yielded nothing")

    # ------------------------------------------------------------------ the loop

    def run(self, items: Iterable[Any],
            prepare: Callable[[Any], tuple[list[int], SamplingParams]],
            observer_for: Callable[[Any], Observer | None] | None = None,
            *, continue_job: bool = False,
            ) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        """Generate every item; yield (item, result) as rows finish.

        prepare(item) -> (prompt ids, sampling); an exception it raises (a RecordFailure...)
        is yielded as that item's result. A failure of a batched forward pass other than
        out-of-memory is yielded for every row in the batch. observer_for(item) -> an observer
        of that record's steps ([1, k] slices); it is called again when an out-of-memory
        error restarts the record, so a fresh observer can drop the aborted steps.
        A run is one job: the n-gram drafter's job corpus starts empty, unless continue_job;
        the prefix cache lives as long as the engine (a prompt's keys/values depend on the
        target alone).
        """
        if not continue_job:
            self.forget_earlier_records()
        yield from Admission(self, items, prepare, observer_for).run()

    # ------------------------------------------------------------------ rows

    def reset_rows(self, fresh: bool = False) -> None:
        """No active row. A slot cache of the same kind is kept, emptied of rows: its buffers
        and its captured shapes live with the loaded model, so the next run (or record, or
        bench row) captures nothing again; ``fresh`` (after out-of-memory) builds a new one."""
        self.rows: list[Row] = []
        # The target's cache, one row per record: in slots at every batch size, or one row,
        # rolled back in place, for a model slots cannot hold.
        kind = (self.plan, self.tap)
        if not fresh and isinstance(getattr(self, "kv", None), SlotCache) and self.kv_kind == kind:
            self.kv.clear_rows()
        elif self.slots_fit:
            self.kv = SlotCache.for_step(self.model, self.device, self.plan, slots=self.batch_size,
                                         pad_id=self.pad_id, tap=self.tap)
        else:
            self.kv = ContiguousCache(self.model, self.device)
        self.kv_kind = kind
        self.drafters.reset()

    def use_drafters(self, drafters: BatchedDrafter) -> None:
        """Draft with `drafters` from the next record on (between jobs: no row is active), and
        capture the target features it reads (train-head wraps the drafter to record them)."""
        if self.rows:
            raise RuntimeError("use_drafters: rows are still active")
        if drafters.tree is not self.tree:
            raise ValueError("use_drafters: the new drafter must draft the same tree shape")
        self.drafters = drafters
        self.tap = FeatureTap(self.model, drafters.feature_layers) if drafters.feature_layers else None
        self.drafters.use_plan(self.plan)
        self.last_features = None
        # its entries hold the features the previous drafter read
        self.prefix = PrefixCache(self.prefix.capacity, features=self.tap is not None)
        self.prefiller.cache = self.prefix
        self.drafters.reset()

    @property
    def step_kind(self) -> str:
        """The plan's kind, for reports: "eager", "static", "graphs" or "compiled"."""
        return self.plan.kind

    def forget_earlier_records(self) -> None:
        """Empty the job corpus the n-gram drafter falls back on (drafters.ngram.JobCorpus),
        so that what ran before (bench's warm-up, another seed's pass) cannot draft for what
        comes next. A no-op without one."""
        corpus = getattr(self.drafters, "corpus", None)
        if corpus is not None:
            corpus.clear()

    def keep(self, keep: list[int]) -> None:
        """Keep only these batch rows (a finished row leaves at once)."""
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep_rows(keep)
        self.drafters.keep(keep)

    def drop_unfinished_rows(self) -> None:
        """Rows whose start failed half-way leave no trace in the cache or the drafter."""
        n = len(self.rows)
        if n == 0:
            self.kv.clear_rows()
        elif self.kv.rows > n:
            self.kv.keep_rows(list(range(n)))
        self.drafters.keep(list(range(n)))

    @staticmethod
    def result(seq: Sequence, logprobs: list | None) -> GenerationResult:
        res = seq.result()
        if logprobs is not None:  # stop strings may have cut tokens the steps emitted
            res.logprobs = logprobs[: len(res.token_ids)]
        return res

    def halve(self) -> bool:
        """Halve the batch after an out-of-memory error; False if it is already 1."""
        self.prefix.clear()  # memory is short
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.batch_size <= 1:
            return False
        self.batch_size = max(1, self.batch_size // 2)
        self.oom_retries += 1
        return True

    def evict_all(self) -> list[Row]:
        rows = self.rows
        self.reset_rows(fresh=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return rows

    def start_rows(self, joiners: list[Joiner]) -> list[int]:
        """Prefill the joiners' prompts together and append their rows, in order
        (marscli.models.prefill). Where the first output token comes from the prefill pass
        (``first_from_prefill``), the whole prompt is prefilled and the first position is
        judged on the logits at its last token, as a step with nothing drafted would judge
        it (the drafter's proposal for it, the position's draw): the rows that finish there
        are returned (batch indices). Otherwise the prompt but its last token is prefilled
        and the first step computes the first token."""
        t0 = time.perf_counter()
        first = self.first_from_prefill
        B = len(self.rows)
        try:
            prompts = [list(j.ids if first else j.ids[:-1]) for j in joiners]
            logits = None
            if isinstance(self.kv, SlotCache):
                done = self.prefiller.prefill(prompts, self._captured, logits=first)
                self.kv.add_rows([(p.kv, p.length) for p in done])
                features = [p.features for p in done]
                if first:
                    logits = torch.stack([p.logits for p in done]).unsqueeze(1)  # [n, 1, V]
            else:  # a model slots cannot hold: the plain single-sequence call, after the cached prefix
                assert len(joiners) == 1, "a contiguous cache takes one row"
                f, last = self._prefill_alone(prompts[0], last=first)
                features = [f]
                if first:
                    logits = last.view(1, 1, -1)
            self.drafters.add_rows([list(j.ids) for j in joiners], [j.sampling for j in joiners])
            for b, (j, f) in enumerate(zip(joiners, features)):
                if f is not None and f.shape[0]:  # the prompt's target features, for a drafter that reads them
                    self.drafters.observe(B + b, f)
                # cached: the prompt but its last token, which the prefill computed as a
                # step computes its pending token (the verdict below counts it kept)
                self.rows.append(Row(j.item, j.ids, j.sampling, j.seq, len(j.ids) - 1,
                                     [] if j.sampling.logprobs else None))
            if not first:
                return []
            nexts: list[int | None] = [None] * len(joiners)
            if self.bonus:  # each row's proposal for its first position, from its prompt
                nexts = [p.next for p in self.drafters.propose_rows(B, [j.seq.seq for j in joiners])]
            finished, _, _ = self._verify_commit(B, [[] for _ in joiners], nexts,
                                                 logits.new_zeros(len(joiners), 0, dtype=torch.long),
                                                 logits, None)
            return finished
        except BaseException:
            del self.rows[B:]  # no half-started row stays (drop_unfinished_rows clears the rest)
            raise
        finally:
            self.prefill_seconds += time.perf_counter() - t0

    @property
    def first_from_prefill(self) -> bool:
        """Is a joining row's first output token judged on the prefill pass's logits (as
        transformers' generate() takes it), saving every record a step? For drafters whose
        proposal for a position comes from the row's own text on the host (none, n-gram),
        chains only, no target features read, and not while collecting for calibration
        (whose steps draft a fixed K from the first position on)."""
        return self._first_ok and self.tap is None and isinstance(self.drafters, RowDrafters)

    def _prefill_alone(self, prompt: list[int], last: bool = False
                       ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Prefill one prompt into the contiguous cache (a model slots cannot hold) after the longest
        cached prefix; insert it into the prefix cache. Returns its features [L, F] (None
        when none are read) and, with `last`, the logits [V] at its last token (which is
        then computed even when the cache holds the whole prompt)."""
        m, past, past_f = self.prefix.match(prompt[:-1] if last else prompt)
        rest = prompt[m:]
        logits = self.kv.add_prefilled(rest, run=self._captured, past=(m, past) if m else None)
        p = self.prefiller
        p.reused += m
        features = None
        if self.tap is not None:
            new = self.last_features[0] if rest else None
            features = new if not m else (past_f if new is None else torch.cat([past_f, new], 0))
        if rest:
            p.passes += 1
            p.tokens += len(rest)
            self.prefix.insert(prompt, self.kv.row_kv(len(prompt)), features if self.prefix.features else None)
        return features, logits

    def reset_measurements(self) -> None:
        """Start a measured run cold for prompts but warm for kernels (after a warm-up run):
        empty the prefix cache and the n-gram job corpus, zero the prefill counters and the
        cache's peak."""
        self.forget_earlier_records()
        self.prefix.clear()
        self.prefill_seconds = 0.0
        self.peak_cache_bytes = 0
        self.prefiller.reset_counters()

    @property
    def prefix_tokens_reused(self) -> int:
        """Prompt tokens that joining rows took from the prefix cache instead of computing."""
        return self.prefiller.reused

    # ------------------------------------------------------------------ steps

    def step(self) -> list[int]:
        """One speculative step for every active row; returns the rows that finished."""
        caps = [r.seq.k_cap() for r in self.rows]
        seqs = [r.seq.seq for r in self.rows]
        if self.tree is not None:
            r = self.rows[0]
            if getattr(self.tree, "chooses_length", False) and caps[0] > 0:
                # a draft model's tree: its chain's length is chosen as a chain's would be
                caps = self.lengths(self.drafters.offers(seqs, caps), caps)
            tokens, parents, _ = self.drafters.propose_tree(0, r.seq.seq, caps[0]) if caps[0] > 0 else ([], [], [])
            if tokens:
                return self._tree_step(tokens, parents)
            return self._chain_step([Proposal([])], [0])  # nothing to draft: a plain step
        ks = self.lengths(self.drafters.offers(seqs, caps), caps)
        return self._chain_step(self.drafters.propose(seqs, ks, bonus=self.bonus), ks)

    def lengths(self, offers, caps: list[int]) -> list[int]:
        """Every row's draft length this step (marscli.engine.lengths)."""
        left = None
        if self.drained:  # the rows that may finish last: the most tokens left
            left = [r.seq.left for r in self.rows]
        return step_lengths(offers, caps, self.costs, len(self.rows), adaptive=self.adaptive,
                            fixed=self.fixed_lengths, left=left, bonus_drafts=self.bonus_drafts)

    def _chain_step(self, proposals: list[Proposal], ks: list[int]) -> list[int]:
        """One chain step for every row: one forward, one verification, one transfer, commit."""
        rows = self.rows
        B = len(rows)
        drafts = [p.tokens[:max(k, 0)] for p, k in zip(proposals, ks)]
        nexts = [p.next if self.bonus else None for p in proposals]
        ks = [len(d) for d in drafts]
        K = max(ks)
        # 1. the forward's inputs: [pending, d_1 .. d_k] a row, right-padded to the longest
        # (built as lists and made tensors once: no per-row tensor on the host)
        pad = [self.pad_id] * K
        ids = torch.tensor([[r.seq.seq[-1], *d, *pad[len(d):]] for r, d in zip(rows, drafts)], dtype=torch.long)
        new_mask = torch.tensor([[1] * (1 + k) + [0] * (K - k) for k in ks], dtype=torch.long)
        pos = torch.tensor([[r.npos + j for j in range(K + 1)] for r in rows], dtype=torch.long)  # [B, K+1]
        # the mask stays on the host too: the commit reads it there (no transfer back)
        ids, mask_on_device, pos = (to_device(t, self.device) for t in (ids, new_mask, pos))
        # 2. one forward
        logits = self._step_forward(ids, mask_on_device, pos).logits  # [B, K+1, V]
        features = self.last_features  # [B, K+1, F] or None
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
        assert logits.shape[:2] == (B, K + 1), tuple(logits.shape)
        # 3. verify, and the step's one device-to-host transfer; 4. commit
        finished, kept, rewound = self._verify_commit(0, drafts, nexts, ids[:, 1:], logits, features)
        for b, n in enumerate(kept):
            new_mask[b, n:] = 0
        self.kv.commit(new_mask, kept)
        for b in rewound:
            self.kv.truncate_row(b, rows[b].npos)
        if not finished:
            self.kv.trim()
        return finished

    def _verify_commit(self, first: int, drafts: list[list[int]], nexts: list[int | None],
                       d_t: torch.Tensor, logits: torch.Tensor, features: torch.Tensor | None,
                       ) -> tuple[list[int], list[int], list[int]]:
        """Judge rows first .. first+B-1 (their drafts d_t [B, K] on the device, padding where
        a row drafts fewer: never accepted, and their proposals after them) on their logits
        [B, K+1, V] in ONE verification and ONE device-to-host transfer, and commit each
        row's tokens. Returns the rows that finished (batch indices), the positions each row
        keeps ([pending, accepted drafts]) and the rows that rewound. A step judges every
        row; a joining group judges its first output position on the prefill's logits (K = 0)."""
        rows = self.rows[first: first + logits.shape[0]]
        seqs = [r.seq for r in rows]
        ks = [len(d) for d in drafts]
        K = max(ks)
        dev = logits.device
        # the target's top-1 everywhere, once: greedy verification, MARS's top two and the
        # stop guard all read it (a pass over the vocabulary each)
        top1 = logits.argmax(dim=-1) if self.rule.relaxes or any(s.sampling.greedy for s in seqs) else None
        inputs = chain_inputs(seqs, drafts, nexts, K, logits, relaxes=self.rule.relaxes,
                              regret=self.rule.name == REGRET and self.rule.relaxes, top1=top1)
        res = verify_rows(d_t, logits, torch.tensor(ks, dtype=torch.long, device=dev), self.rule,
                          [s.sampling for s in seqs], bonus=inputs.bonus, seeds=inputs.seeds,
                          positions=inputs.positions, guard=inputs.guard, relax_left=inputs.relax_left,
                          regret_carry=inputs.regret, top1=top1)
        # Sent with the verdicts: the rule's statistic at every position when a row reports
        # provenance, then packed logprobs.
        with_stat = any(s.provenance is not None for s in seqs)
        T = 0
        extra = None
        if any(r.logprobs is not None for r in rows):
            T = max(r.sampling.top_logprobs for r in rows if r.logprobs is not None)
            extra = lp.pack(*lp.gather(logits, lp.emitted_tokens(d_t, res.num_accepted, res.next_token), T))
        verdicts = res.host_rows(with_stat, extra)
        finished, rewound = [], []
        kept = [1 + k for k in ks]  # positions each row keeps (the commit's, read on the host)
        for i, (r, d) in enumerate(zip(rows, drafts)):
            b = first + i
            k, v, seq = ks[i], verdicts[i], r.seq
            n = v.num_accepted
            judged = n < k or nexts[i] is not None  # a proposal was judged at position n
            refused, span_refused = v.refused, 0
            if refused and inputs.spans is not None and n < len(inputs.spans[i]) and inputs.spans[i][n]:
                refused, span_refused = 0, 1  # a strict span refused it: counted there only
            observation = None
            if seq.observer is not None:
                observation = self._chain_observation(i, k, d_t, logits, res, seq.sampling, nexts[i],
                                                      inputs.guard, inputs.spans)
            origin = None
            if seq.provenance is not None:
                flags = v.relaxed[: n + 1]
                origin = (step_kinds(flags, n, k), [v.statistic[j] if flags[j] else None for j in range(n + 1)])
            if v.regret is not None:
                seq.regret = v.regret
            emitted = seq.commit(d[:n] + [v.next_token], k, n, v.relaxed[: n + 1],
                                 sum(v.relaxable[: n + 1]), observation, refused=refused,
                                 span_refused=span_refused, origin=origin, decided=n + int(judged))
            if r.logprobs is not None:
                r.logprobs += lp.unpack(v.extra, emitted, T, r.sampling.top_logprobs)
            if features is not None:  # the positions the target keeps: pending + accepted drafts
                self.drafters.observe(b, features[i, : len(emitted)])
            self.drafters.accepted(b, k, n, seq.seq)
            kept[i] = 1 + n
            r.npos += 1 + n
            if seq.rewound_at is not None:  # a relaxation taken back: the row follows its text
                rewound.append(b)
                r.npos = len(seq.seq) - 1
                if r.logprobs is not None:
                    del r.logprobs[len(seq.out):]
                self.drafters.rewind(b, seq.seq)
            if seq.done:
                finished.append(b)
        return finished, kept, rewound

    @staticmethod
    def _chain_observation(b, k, d_t, logits, res, sampling, nxt, guard, spans) -> Callable[[int], StepObservation]:
        W = k + 1

        def make(emitted: int) -> StepObservation:
            span = None
            if spans is not None:
                flags = (spans[b] + [False] * W)[:W]
                span = torch.tensor([flags], dtype=torch.bool).view(1, W)
            return StepObservation(d_t[b: b + 1, :k], logits[b: b + 1, :W], res.row(b, k), sampling, emitted,
                                   next_proposal=nxt, guard=None if guard is None else guard[b: b + 1, :W],
                                   strict_span=span)
        return make

    def _tree_step(self, tokens: list[int], parents: list[int]) -> list[int]:
        """One step with a draft tree (batch size 1): one target pass over root + all nodes
        (tree mask and tree position ids), verification along the tree, then only the
        accepted path stays in the cache."""
        r = self.rows[0]
        seq = r.seq
        tree = DraftTree(tokens, parents)
        base = r.npos  # the positions cached before the root
        ids, pos, block = tree_block(tree, seq.seq[-1], base, self.device)  # trees need slots (check_tree_support)
        logits = self._step_forward(ids, None, pos, block=block).logits[0].float()  # [N+1, V]
        N = len(tree)
        s = seq.sampling
        depths = tree.depth_list()
        guard, span = tree_guard(seq, tokens, parents, logits, depths)
        res = verify_tree(tree, logits, rule=self.rule, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, seed=s.seed, position=len(seq.out), guard=guard,
                          relax_left=seq.relax_left())
        path = list(res.path)
        n = len(path)
        depth = max(depths)
        rows = [0] + [i + 1 for i in path]  # logits rows that decided something
        decided = rows[: min(n + 1, depth)]  # rows whose children were judged
        relaxable = sum(res.relaxable_rows[r] for r in decided)
        seq.stats.tree_nodes += N
        observation = None
        if seq.observer is not None:
            def observation(emitted: int) -> StepObservation:
                return StepObservation(
                    tree.tokens[path].view(1, n) if n else torch.zeros(1, 0, dtype=torch.long),
                    logits[rows].unsqueeze(0), res, s, emitted, tree=tree,
                    tree_logits=logits, guard=guard, strict_span=span)
        origin = None
        if seq.provenance is not None:
            kids = tree.child_lists()
            stat = res.statistic if res.node_statistic is None else None
            stats = []
            for j, i in enumerate(path):
                if not res.relaxed[j]:
                    stats.append(None)
                elif stat is not None:  # MARS: the statistic of the row that judged the node
                    stats.append(float(stat[rows[j]]))
                else:
                    stats.append(float(res.node_statistic[i]))
            origin = (step_kinds(res.relaxed, n, N, bonus=not kids[rows[-1]]), stats + [None])
        emitted = seq.commit([tokens[i] for i in path] + [res.next_token], depth, n,
                             list(res.relaxed) + [False], relaxable, observation, origin=origin)
        if r.logprobs is not None and emitted:
            T = s.top_logprobs
            got = lp.gather(logits[rows[: len(emitted)]].unsqueeze(0),
                            torch.tensor([emitted], dtype=torch.long, device=logits.device), T)
            r.logprobs += lp.unpack(lp.pack(*got)[0].cpu().tolist(), emitted, T, T)
        if self.last_features is not None:
            self.drafters.observe(0, self.last_features[0, rows][: len(emitted)])
        self.drafters.accepted(0, depth, n, seq.seq)
        self.kv.keep_path(0, path)
        r.npos += 1 + n
        return [0] if seq.done else []

    # ------------------------------------------------------------------ target passes

    def _step_forward(self, ids: torch.Tensor, new_mask: torch.Tensor | None, pos: torch.Tensor, **kw):
        """A step's target forward over the cache (kw: a tree's block, SlotCache.forward); its
        features in last_features. A captured step's cache hooks them out itself (a graph's
        replay runs no hook)."""
        if self.plan.static and self.tap is not None:
            out = self.kv.forward(ids, new_mask, pos, **kw)
            self.last_features = out.features
            return out
        return self._captured(lambda: self.kv.forward(ids, new_mask, pos, **kw))

    def _captured(self, forward: Callable[[], Any]) -> Any:
        """Run a target forward pass, leaving its features in last_features ([B, S, F]; None
        when the drafter reads none)."""
        if self.tap is None:
            self.last_features = None
            return forward()
        with self.tap.capture():
            out = forward()
        self.last_features = self.tap.features
        return out
