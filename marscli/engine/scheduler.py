"""The scheduler: every record of a run decodes here, batch size 1 being a batch of one.

Per step, for all active rows at once: the drafter proposes (``BatchedDrafter.propose``), the
target scores [pending, drafts] of every row in ONE forward pass over the shared cache, the
rulebook verifies every row in ONE call (``marscli.verification.chain.verify_rows``, per-row draft
lengths), the verdicts come to the host in ONE transfer, and each row commits its own
(``Sequence.commit``). A tree step (``--tree-*``: an EAGLE-3 head's tree, or a draft model's
chain with sibling leaves; batch size 1) takes the same path with one tree forward and
``verify_tree``.

- Every step the rows' drafters offer what they could draft (``BatchedDrafter.offers``) and
  the engine picks every row's k_b (``choose_draft_lengths``): strict greedy rows together,
  by expected tokens per measured second of the step (marscli.engine.costs; k_b = 0 and a
  plain step for the whole batch included); relaxed and sampled rows each alone, by the
  fixed reference curve, so that their text never depends on timings or the batch
  (``draft_lengths``, the reproducibility contract). Each active row then feeds
  [pending, d_1 .. d_k_b], right-padded to the step's largest k. After verification row b
  keeps 1 + n_b of its new slots; at batch size > 1 the rejected drafts and the padding stay
  in the cache masked out (marscli.models.kvcache.HoleCache), with explicit per-row position
  ids, so a row's logits are those of its own sequence (only float summation order can differ
  from a single-row pass); at batch size 1 they are rolled back.
- Records join in groups: every free place is filled from the input at once, and the
  joiners' prompts are prefilled together (marscli.models.prefill: padded passes within a
  token budget, each prompt after the longest prefix the run's prefix cache holds of it, a
  prefix several joiners share computed once). A finished row leaves at once and the next
  records take its place (continuous refill); a refill's prefill passes run between steps.
- On CUDA out-of-memory the batch is halved and the affected records restart from scratch
  (their outputs are a function of their seeds, so a restart changes nothing).
- Rows that share a prompt (the n choices of one request) share its prefill through the
  prefix cache.
- A row that asks for logprobs gets them from the step's own logits (marscli.engine.logprobs),
  brought to the host in the step's one transfer.

Results are yielded as rows finish, not in input order (marscli.io restores input order).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

import marscli.engine.logprobs as lp
from marscli.config import (
    GUARD_OFF,
    DraftConfig,
    GuardConfig,
    SamplingParams,
    SpanConfig,
)
from marscli.drafters.base import (
    MIN_GAIN,
    BatchedDrafter,
    DraftOffer,
    Proposal,
    choose_draft_lengths,
    expected_tokens,
)
from marscli.drafters.eagle3_head import FeatureTap
from marscli.drafters.kinds import drafter_kind
from marscli.engine.costs import reference_costs, static_costs
from marscli.engine.prompts import PromptEncoder
from marscli.engine.provenance import step_kinds
from marscli.engine.sequence import (
    GenerationResult,
    RowSettings,
    Sequence,
    StepObservation,
)
from marscli.engine.tree_forward import check_tree_support, tree_block, tree_forward
from marscli.errors import UsageError
from marscli.models.fastpath import install_cpu_fastpath
from marscli.models.kvcache import HoleCache, sliding_layers
from marscli.models.prefill import DEFAULT_PREFIX_CACHE_MIB, MIB, Prefiller, PrefixCache
from marscli.models.slots import SlotCache
from marscli.models.slots import supports as supports_slots
from marscli.verification.chain import verify_rows
from marscli.verification.registry import Rule
from marscli.verification.rules import stop_positions
from marscli.verification.spans import SpanRule
from marscli.verification.tree import DraftTree, verify_tree

Observer = Callable[[StepObservation], None]
#: A relaxed or sampled row sits out at most this many steps in a row (Engine.waiting_rows).
MAX_WAIT = 4


def oom_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean 'the batch did not fit' (torch.cuda.OutOfMemoryError exists on
    CPU builds too, so a CPU test can raise it)."""
    return (torch.cuda.OutOfMemoryError,)


@dataclass
class _Row:
    item: Any
    ids: list[int]
    sampling: SamplingParams
    seq: Sequence
    npos: int  # valid tokens in the cache (the whole committed sequence but the pending token)
    logprobs: list[lp.TokenLogprob] | None = None  # per emitted token, when the record asks
    waited: int = 0  # steps this row has sat out in a row (Engine.waiting_rows)


@dataclass
class _Joiner:
    """A record about to join the batch: its prompt, sampling and fresh Sequence."""

    item: Any
    ids: list[int]
    sampling: SamplingParams
    seq: Sequence


def fill_order(rows: int, gone: list[int]) -> list[int]:
    """The rows that stay when rows `gone` leave, in the order that moves the fewest: a place
    freed below the new end is taken by a staying row from past it; every other row keeps its
    place. So one leaving row moves at most one row's keys and values (with the rows after it
    shifting down, a leaving row near the front moved almost the whole batch)."""
    out = set(gone)
    n = rows - len(out)
    order = list(range(n))
    movers = iter(b for b in range(n, rows) if b not in out)
    for b in range(n):
        if b in out:
            order[b] = next(movers)
    return order


def step_kind(mode: str, device, model) -> str:
    """How an engine's steps run for --compile `mode` (config.COMPILE_MODES):

    - "graphs": static shapes replayed as CUDA graphs; on CUDA for auto and on;
    - "compiled": static shapes compiled by torch.compile (inductor); on a CPU for on only:
      auto stays eager there, because the compilations cost more than they save on a typical
      run (docs/engine.md, "The captured step");
    - "static" (an internal mode): the captured step's shapes, run eagerly (what tests check
      on a CPU);
    - "eager" otherwise, and for models a slot cache cannot hold (sliding windows, flash
      attention).

    Chain and tree steps alike; an EAGLE-3 head's target features are outputs of the step,
    and its own chain passes follow the step kind (marscli.drafters.eagle3.HeadSteps)."""
    if mode == "off" or (mode == "auto" and device.type != "cuda"):
        return "eager"
    if not supports_slots(model):
        return "eager"
    if mode == "static":
        return "static"
    return "graphs" if device.type == "cuda" else "compiled"


class Engine:
    """Speculative generation for one target, one drafter and one verification rule.

    target: a LoadedModel (.model, .tokenizer, .device, .eos_token_ids, .context_length).
    drafters: the BatchedDrafter for the run (marscli.drafters.factory.build_drafters).
    costs: the measured step costs (marscli.engine.costs.StepCosts) the draft lengths are chosen
    by; None: the static curve for the target's device.
    prefix_cache_mib: the bound of the run's prefix cache (0: none; marscli.models.prefill).
    """

    def __init__(self, target, drafters: BatchedDrafter, rule: Rule, draft_cfg: DraftConfig,
                 batch_size: int = 1, costs=None, guard: GuardConfig = GUARD_OFF,
                 spans: SpanConfig | None = None, prefix_cache_mib: float = DEFAULT_PREFIX_CACHE_MIB,
                 slot_cache: bool = True, compile_mode: str = "auto"):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.target = target
        self.model = target.model
        self.device = target.device
        self.drafters = drafters
        self.rule = rule
        self.batch_size = batch_size
        if costs is None:
            costs = static_costs(self.device.type)
        self.costs = costs
        #: The fixed curve relaxed and sampled rows choose their draft lengths by (never a
        #: measurement: their text must not depend on timings); build_engine sets the draft
        #: model's share of the bytes.
        self.reference = reference_costs()
        self.adaptive = draft_cfg.adaptive
        self.solo_lengths = False  # True: rows choose draft lengths as if alone (calibration)
        self.drained = False  # no record waits for a row: draft lengths aim at the job's end
        hybrid = getattr(drafters, "hybrid_costs", None)
        if hybrid is not None:  # hybrid drafters price their source by this engine's curves
            hybrid.owner = self
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
                                    k_max, target.context_length, guard, rule.relaxes, self.spans)
        # A drafter that drafts from the target's hidden states (EAGLE-3) names the layers it
        # reads; every target forward pass then captures them (no second pass).
        self.tap = None
        if drafters.feature_layers:
            self.tap = FeatureTap(self.model, drafters.feature_layers)
        self.last_features: torch.Tensor | None = None  # [B, S, F] from the newest forward pass
        tok = target.tokenizer
        self.pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
        sliding = sliding_layers(self.model)
        if batch_size > 1:
            if sliding:
                raise ValueError(
                    "batched decoding does not support models with sliding-window attention "
                    f"layers (layers {sliding[:4]}...); use --batch-size 1")
        if self.device.type == "cpu":
            install_cpu_fastpath(self.model)
        #: Batched rows keep their keys and values in a slot cache (marscli.models.slots);
        #: False: the hole cache (marscli.models.kvcache.HoleCache), as before it.
        self.slot_cache = slot_cache
        #: How a step's forward runs: "eager"; "graphs" (static shapes replayed as CUDA
        #: graphs); "compiled" (those shapes compiled by torch.compile); "static" (those
        #: shapes, eagerly: tests). step_kind() says when.
        self.compile_mode = compile_mode
        self.step_kind = step_kind(compile_mode, self.device, self.model)
        if self.step_kind != "eager" and not slot_cache:
            raise ValueError("captured steps run on the slot cache")
        self._drafters_step_kind()
        self.oom_retries = 0  # how many times the batch was halved (for reports and tests)
        self.peak_cache_bytes = 0  # largest target KV cache seen (holes and padding included)
        self.prefill_seconds = 0.0  # time spent prefilling joining records
        # Sliding-window layers keep state of their own beside keys/values: no prefix reuse.
        self.prefix = PrefixCache(0 if sliding else int(prefix_cache_mib * MIB), features=self.tap is not None)
        self.prefiller = Prefiller(self.model, self.device, self.prefix, self.pad_id,
                                   features=lambda: self.last_features)
        self._reset()

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
        yield from self._loop(items, prepare, observer_for)

    def _loop(self, items, prepare, observer_for) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        source = iter(items)
        retry: deque[tuple[Any, list[int], SamplingParams]] = deque()
        ahead: deque[Any] = deque()  # at most one record read early, to know whether any is left
        exhausted = False
        self._reset()
        with torch.inference_mode():
            while True:
                # Refill: pending records take the free places (restarted ones first), and
                # join together.
                while len(self.rows) < self.batch_size:
                    joiners: list[_Joiner] = []
                    while len(self.rows) + len(joiners) < self.batch_size:
                        if retry:
                            item, ids, sampling = retry.popleft()
                        else:
                            if ahead:
                                item = ahead.popleft()
                            else:
                                try:
                                    item = next(source)
                                except StopIteration:
                                    exhausted = True
                                    break
                            try:
                                ids, sampling = prepare(item)
                            except Exception as e:  # noqa: BLE001 - a RecordFailure or a tokenizer fault: this record only
                                yield item, e
                                continue
                        try:
                            seq = Sequence(self.settings, ids, sampling,
                                           observer=observer_for(item) if observer_for else None)
                        except Exception as e:  # noqa: BLE001 - this record only
                            yield item, e
                            continue
                        if seq.done:  # no room for a single new token: it never joins
                            yield item, self._result(seq, [] if sampling.logprobs else None)
                            continue
                        joiners.append(_Joiner(item, ids, sampling, seq))
                    if not joiners:
                        break
                    try:
                        self._start_rows(joiners)
                    except oom_errors() as e:
                        self._drop_unfinished_rows()
                        if self._halve():
                            for j in reversed(joiners):
                                retry.appendleft((j.item, j.ids, j.sampling))
                            for r in reversed(self._evict_all()):
                                retry.appendleft((r.item, r.ids, r.sampling))
                            continue
                        for j in joiners:
                            yield j.item, e
                    except Exception as e:  # noqa: BLE001 - alone, one record's failure ends only it
                        self._drop_unfinished_rows()
                        if len(joiners) == 1:
                            yield joiners[0].item, e
                            continue
                        for j in joiners:
                            try:
                                self._start_rows([j])
                            except Exception as e:  # noqa: BLE001
                                self._drop_unfinished_rows()
                                yield j.item, e
                if not self.rows:
                    return
                # A full batch looks one record ahead (never at batch size 1, where a caller
                # may feed the next record only after reading this one's result): when none
                # is left, the draft lengths aim at the end of the job (draft_lengths).
                if self.batch_size > 1 and not exhausted and not ahead and not retry:
                    try:
                        ahead.append(next(source))
                    except StopIteration:
                        exhausted = True
                self.drained = exhausted and not retry and not ahead
                try:
                    finished = self._step()
                except oom_errors() as e:
                    if self._halve():
                        for r in reversed(self._evict_all()):
                            retry.appendleft((r.item, r.ids, r.sampling))
                        continue
                    for r in self._evict_all():
                        yield r.item, e
                    continue
                except Exception as e:  # noqa: BLE001 - the batch's records fail, the run goes on
                    for r in self._evict_all():
                        yield r.item, e
                    continue
                if finished:
                    done_rows = [self.rows[b] for b in finished]
                    self._keep(fill_order(len(self.rows), finished))
                    for r in done_rows:
                        yield r.item, self._result(r.seq, r.logprobs)

    # ------------------------------------------------------------------ rows

    def _reset(self) -> None:
        self.rows: list[_Row] = []
        # The target's cache, one row per record: masked with holes when rows share it,
        # rolled back in place at batch size 1.
        if self.step_kind != "eager":  # at every batch size, batch size 1 included
            self.kv = SlotCache.for_step(self.model, self.device, self.step_kind, slots=self.batch_size,
                                         pad_id=self.pad_id, tap=self.tap)
        elif self.batch_size > 1 and self.slot_cache:
            self.kv = SlotCache(self.model, self.device, slots=self.batch_size)
        else:
            self.kv = HoleCache(self.model, self.device, masked=self.batch_size > 1,
                                batch_capacity=self.batch_size)
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
        self.step_kind = step_kind(self.compile_mode, self.device, self.model)
        self._drafters_step_kind()
        self.last_features = None
        # its entries hold the features the previous drafter read
        self.prefix = PrefixCache(self.prefix.capacity, features=self.tap is not None)
        self.prefiller.cache = self.prefix
        self.drafters.reset()

    def _drafters_step_kind(self) -> None:
        """A batched draft model's steps run as the target's do (BatchedModelDrafter)."""
        if hasattr(self.drafters, "step_kind"):
            self.drafters.step_kind = self.step_kind

    def forget_earlier_records(self) -> None:
        """Empty the job corpus the n-gram drafter falls back on (drafters.ngram.JobCorpus),
        so that what ran before (bench's warm-up, another seed's pass) cannot draft for what
        comes next. A no-op without one."""
        corpus = getattr(self.drafters, "corpus", None)
        if corpus is not None:
            corpus.clear()

    def _keep(self, keep: list[int]) -> None:
        """Keep only these batch rows (a finished row leaves at once)."""
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep_rows(keep)
        self.drafters.keep(keep)

    def _drop_unfinished_rows(self) -> None:
        """Rows whose start failed half-way leave no trace in the cache or the drafter."""
        n = len(self.rows)
        if n == 0:
            self.kv.reset()
        elif self.kv.rows > n:
            self.kv.keep_rows(list(range(n)))
        self.drafters.keep(list(range(n)))

    @staticmethod
    def _result(seq: Sequence, logprobs: list | None) -> GenerationResult:
        res = seq.result()
        if logprobs is not None:  # stop strings may have cut tokens the steps emitted
            res.logprobs = logprobs[: len(res.token_ids)]
        return res

    def _halve(self) -> bool:
        """Halve the batch after an out-of-memory error; False if it is already 1."""
        self.prefix.clear()  # memory is short
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.batch_size <= 1:
            return False
        self.batch_size = max(1, self.batch_size // 2)
        self.oom_retries += 1
        return True

    def _evict_all(self) -> list[_Row]:
        rows = self.rows
        self._reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return rows

    def _start_rows(self, joiners: list[_Joiner]) -> None:
        """Prefill the joiners' prompts (but each one's pending last token) together and
        append their rows, in order (marscli.models.prefill)."""
        t0 = time.perf_counter()
        try:
            prompts = [list(j.ids[:-1]) for j in joiners]
            if self.kv.masked:
                done = self.prefiller.prefill(prompts, self._captured)
                self.kv.add_rows([(p.kv, p.length) for p in done])
                features = [p.features for p in done]
            else:  # batch size 1: the plain single-sequence call, after the cached prefix
                assert len(joiners) == 1, "a contiguous cache takes one row"
                features = [self._prefill_alone(prompts[0])]
            B = len(self.rows)
            self.drafters.add_rows([list(j.ids) for j in joiners], [j.sampling for j in joiners],
                                   [j.seq.draft_gen for j in joiners])
            for b, (j, f) in enumerate(zip(joiners, features)):
                if f is not None and f.shape[0]:  # the prompt's target features, for a drafter that reads them
                    self.drafters.observe(B + b, f)
                self.rows.append(_Row(j.item, j.ids, j.sampling, j.seq, len(j.ids) - 1,
                                      [] if j.sampling.logprobs else None))
        finally:
            self.prefill_seconds += time.perf_counter() - t0

    def _prefill_alone(self, prompt: list[int]) -> torch.Tensor | None:
        """Prefill one prompt into the contiguous cache (batch size 1) after the longest
        cached prefix; insert it into the prefix cache. Returns its features [L, F] (None
        when none are read)."""
        m, past, past_f = self.prefix.match(prompt)
        rest = prompt[m:]
        self.kv.add_prefilled(rest, run=self._captured, past=(m, past) if m else None)
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
        return features

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

    def _step(self) -> list[int]:
        """One speculative step for every active row; returns the rows that finished."""
        caps = [r.seq.k_cap() for r in self.rows]
        if self.tree is not None:
            r = self.rows[0]
            if getattr(self.tree, "chooses_length", False) and caps[0] > 0:
                # a draft model's tree: its chain's length is chosen as a chain's would be
                caps = self.draft_lengths(self.drafters.offers([r.seq.seq], caps), caps)
            tokens, parents, _ = self.drafters.propose_tree(0, r.seq.seq, caps[0]) if caps[0] > 0 else ([], [], [])
            if tokens:
                return self._tree_step(tokens, parents)
            proposals = [Proposal([])]  # nothing to draft (budget, or no features yet): a plain step
        else:
            seqs = [r.seq.seq for r in self.rows]
            offers = self.drafters.offers(seqs, caps)
            caps = self.draft_lengths(offers, caps)
            waiting = self.waiting_rows(offers, caps)
            proposals = self.drafters.propose(seqs, [0 if w else c for w, c in zip(waiting, caps)])
            return self._chain_step(proposals, caps, waiting)
        return self._chain_step(proposals, caps)

    def waiting_rows(self, offers: list[DraftOffer], ks: list[int]) -> list[bool]:
        """The rows that sit this step out: rows whose draft length is fixed by the reference
        curve (relaxed and sampled rows) and longer than the step's best cap.

        Every row of a step is padded to the step's longest draft, so one row drafting 8
        makes the whole batch verify 9 positions a row; on a compute-bound device that costs
        several plain steps. A strict greedy row's lengths already follow the batch's costs,
        but a relaxed row's may not (its text depends on them: the reproducibility
        contract). It may wait instead: a row that does not step keeps its state, so it
        drafts the same k with the same text the next step, and only *when* it steps
        follows the measured costs. The cap C maximises the expected tokens of the rows with
        k_b <= C per measured second of a step capped at C; a row waits at most MAX_WAIT steps
        in a row (then C covers it)."""
        B = len(self.rows)
        fixed = [self.solo_lengths or self.fixed_schedule(r.seq.sampling) for r in self.rows]
        if B < 2 or not self.adaptive or not any(f and k > 0 for f, k in zip(fixed, ks)):
            return [False] * B
        floor = max([k for f, k in zip(fixed, ks) if not f] + [0])  # the strict rows' own choice
        for r, f, k in zip(self.rows, fixed, ks):
            if f and r.waited >= MAX_WAIT:
                floor = max(floor, k)
        gain = [expected_tokens(o.alpha, k) for o, k in zip(offers, ks)]
        best_c, best = floor, -1.0
        for c in sorted({floor} | {k for f, k in zip(fixed, ks) if f and k > floor}):
            value = sum(g for g, f, k in zip(gain, fixed, ks) if not f or k <= c)
            rate = value / self.costs.step(B, c)
            if rate > best * (1.0 + MIN_GAIN):
                best_c, best = c, rate
        waiting = [f and k > best_c for f, k in zip(fixed, ks)]
        for r, w in zip(self.rows, waiting):
            r.waited = r.waited + 1 if w else 0
        if all(waiting):  # cannot happen (C covers the floor's rows); never a step of nobody
            return [False] * B
        return waiting

    def draft_lengths(self, offers: list[DraftOffer], caps: list[int]) -> list[int]:
        """Every row's draft length this step (at most its cap).

        The reproducibility contract (docs/verification.md): a record's text never depends on
        the batch, its neighbours or measured timings. A strict greedy row's text cannot
        change with its draft lengths, so those rows get the batch's best goodput by the
        measured step costs. Every other row (a relaxed rule's verdicts, and a sampled row's
        draws, follow what was drafted) chooses its own length as if alone, by a fixed
        reference curve (``self.reference``: engine.costs.reference_costs, a function of the
        models only) and its own acceptance history; so does every row with solo_lengths
        (calibration, so that a profile describes the drafts its rule will get)."""
        B = len(offers)
        ks = [0] * B
        alone = [b for b, r in enumerate(self.rows) if self.solo_lengths or self.fixed_schedule(r.seq.sampling)]
        for b in alone:
            ks[b] = choose_draft_lengths([offers[b]], lambda L: self.reference.step(1, L), self.adaptive,
                                         draft_seconds=lambda L: self.reference.draft(1, L))[0]
        free = sorted(set(range(B)) - set(alone))
        if free:
            critical = None
            if self.drained and len(free) > 1:  # the rows that may finish last: the most tokens left
                left = [self.rows[b].seq.max_new - len(self.rows[b].seq.out) for b in free]
                most = max(left)
                critical = [n == most for n in left]
            chosen = choose_draft_lengths([offers[b] for b in free], lambda L: self.costs.step(B, L),
                                          self.adaptive, critical, lambda L: self.costs.draft(B, L))
            for b, k in zip(free, chosen):
                ks[b] = k
        return [max(min(k, cap), 0) for k, cap in zip(ks, caps)]

    def fixed_schedule(self, sampling: SamplingParams) -> bool:
        """Does a row's text depend on its draft lengths (a relaxed rule, or sampling)? Such a
        row's lengths follow the reference curve and its own history only (draft_lengths)."""
        return self.rule.relaxes or not sampling.greedy

    def _chain_step(self, proposals: list[Proposal], caps: list[int], waiting: list[bool] | None = None) -> list[int]:
        """One chain step for every row; rows `waiting` sit it out (fed padding only: their
        state, random draws and drafter do not move)."""
        rows = self.rows
        B = len(rows)
        waiting = waiting or [False] * B
        drafts = [[] if w else p.tokens[:max(cap, 0)] for p, cap, w in zip(proposals, caps, waiting)]
        ks = [len(d) for d in drafts]
        K = max(ks)
        ids = torch.full((B, K + 1), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(B, K + 1, dtype=torch.long)
        for b, (r, d) in enumerate(zip(rows, drafts)):
            ids[b, : 1 + len(d)] = torch.tensor([r.seq.seq[-1]] + d)
            new_mask[b, : 1 + len(d)] = 0 if waiting[b] else 1
        npos = torch.tensor([r.npos for r in rows], dtype=torch.long)
        pos = npos[:, None] + torch.arange(K + 1)[None, :]  # [B, K+1]
        ids, new_mask, pos = ids.to(self.device), new_mask.to(self.device), pos.to(self.device)
        logits = self._step_forward(ids, new_mask, pos).logits  # [B, K+1, V]
        features = self.last_features  # [B, K+1, F] or None
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
        assert logits.shape[:2] == (B, K + 1), tuple(logits.shape)

        dev = logits.device
        d_t = ids[:, 1:].clone()  # [B, K] the drafts (padding where k_b < K: never accepted)
        draft_len = torch.tensor(ks, dtype=torch.long, device=dev)  # [B]
        u_acc, u_smp = self._uniforms(ks, K, dev, waiting)
        q = self._draft_probs(proposals, ks, K, logits)
        guard, relax_left, span = self._guards(drafts, K, dev, d_t, logits)
        res = verify_rows(d_t, logits, draft_len, self.rule, [r.seq.sampling for r in rows],
                          u_accept=u_acc, u_sample=u_smp, draft_probs=q, guard=guard,
                          relax_left=relax_left)
        # Sent with the verdicts, in the step's one transfer: the rule's statistic at every
        # position when a row reports provenance, then packed logprobs.
        with_stat = any(r.seq.provenance is not None for r in rows) and K > 0
        T = 0
        if any(r.logprobs is not None for r in rows):  # gathered here, sent with the verdicts
            T = max(r.sampling.top_logprobs for r in rows if r.logprobs is not None)
            extra = lp.pack(*lp.gather(logits, lp.emitted_tokens(d_t, res.num_accepted, res.next_token), T))
        else:
            extra = None
        verdicts = res.host_rows(with_stat, extra)  # the step's one device-to-host transfer
        finished = []
        for b, (r, d) in enumerate(zip(rows, drafts)):
            if waiting[b]:
                continue
            k = ks[b]
            v = verdicts[b]
            n, nxt = v.num_accepted, v.next_token
            relaxed = sum(v.relaxed[:n])
            relaxable = sum(v.relaxable[: min(n + 1, k)])
            refused, span_refused = v.refused, 0
            if refused and span is not None and n < k and span[b][n]:
                refused, span_refused = 0, 1  # a strict span refused it: counted there only
            observation = None
            if r.seq.observer is not None:
                observation = self._chain_observation(b, k, d_t, logits, res, r.seq.sampling, u_acc, q,
                                                      guard, span)
            origin = None
            if r.seq.provenance is not None:
                flags = v.relaxed[:n]
                origin = (step_kinds(flags, n, k),
                          [v.statistic[i] if i < n and flags[i] else None for i in range(n + 1)])
            emitted = r.seq.commit(d[:n] + [nxt], k, n, relaxed, relaxable, observation,
                                   refused=refused, span_refused=span_refused, origin=origin)
            if r.logprobs is not None:
                r.logprobs += lp.unpack(v.extra, emitted, T, r.sampling.top_logprobs)
            if features is not None:  # the positions the target keeps: pending + accepted drafts
                self.drafters.observe(b, features[b, : len(emitted)])
            self.drafters.accepted(b, k, n, r.seq.seq)
            new_mask[b, 1 + n:] = 0
            r.npos += 1 + n
            if r.seq.done:
                finished.append(b)
        self.kv.commit(new_mask)
        if not finished:
            self.kv.trim()
        return finished

    def _guards(self, drafts: list[list[int]], K: int, dev, d_t: torch.Tensor, logits: torch.Tensor
                ) -> tuple[torch.Tensor | None, torch.Tensor | None, list[list[bool]] | None]:
        """The positions a relaxed rule must judge strictly [B, K] (True: never relax this
        draft: the loop guard's verdicts, a strict span, the output's strict first tokens, a
        stop token drafted or chosen by the target), each row's remaining relaxation budget
        [B], and the strict-span flags alone (per row, per draft, on the host); None where
        there is nothing to guard. Strict runs with an observer (calibration) get the
        verdicts too, for the replay."""
        rows = self.rows
        g = self.guard
        wanted = self.rule.relaxes or any(r.seq.observer is not None for r in rows)
        if not wanted or K == 0:
            return None, self._relax_left(dev), None
        m = torch.zeros(len(rows), K, dtype=torch.bool)
        if g.repeat_ngram:
            for b, (r, d) in enumerate(zip(rows, drafts)):
                if d:
                    m[b, : len(d)] = torch.tensor(r.seq.repeats(d), dtype=torch.bool)
        span = None
        if self.spans is not None:
            span = [r.seq.strict_spans(d) for r, d in zip(rows, drafts)]
            for b, f in enumerate(span):
                if any(f):
                    m[b, : len(f)] |= torch.tensor(f, dtype=torch.bool)
        for b, (r, d) in enumerate(zip(rows, drafts)):
            if d and r.seq.strict_first > len(r.seq.out):
                m[b, : len(d)] |= torch.tensor(r.seq.strict_first_flags(list(range(1, len(d) + 1))), dtype=torch.bool)
        guard = m.to(dev)
        stops = [r.seq.stop_tokens for r in rows]
        if any(stops):
            S = max(len(t) for t in stops)
            table = torch.full((len(rows), S), -1, dtype=torch.long)
            for b, t in enumerate(stops):
                table[b, : len(t)] = torch.tensor(t, dtype=torch.long)
            guard = guard | stop_positions(d_t, logits[:, :K], table.to(dev))
        return guard, self._relax_left(dev), span

    def _relax_left(self, dev) -> torch.Tensor | None:
        """Each row's remaining relaxations [B] when the rule relaxes under a budget."""
        if not (self.rule.relaxes and self.guard.budgeted):
            return None
        return torch.tensor([r.seq.relax_left() for r in self.rows], dtype=torch.long).to(dev)

    def _uniforms(self, ks: list[int], K: int, dev, waiting: list[bool]
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Every sampling row's draws for this step ([B, K] and [B]; zeros for greedy rows and
        for rows that wait: they draw nothing)."""
        draws = [(None, None) if w else r.seq.uniforms(k) for r, k, w in zip(self.rows, ks, waiting)]
        if all(r.seq.sampling.greedy for r in self.rows):
            return None, None  # (a waiting sampled row still needs its zeros: verify reads them)
        B = len(self.rows)
        u_acc = torch.zeros(B, K, dtype=torch.float32)
        u_smp = torch.zeros(B, dtype=torch.float32)
        for b, (ua, us) in enumerate(draws):
            if ua is not None:
                u_acc[b, : ks[b]] = ua
                u_smp[b] = us[0]
        return u_acc.to(dev), u_smp.to(dev)

    @staticmethod
    def _draft_probs(proposals: list[Proposal], ks: list[int], K: int,
                     logits: torch.Tensor) -> torch.Tensor | None:
        """The drafts' probabilities q [B, K, V] when some row's drafter samples (None when
        none does: every draft is deterministic, one-hot q). A deterministic row beside them
        (a hybrid row whose n-gram drafted this step, or a greedy draft) gets its one-hot q:
        verified with zeros, its drafts would pass whatever the target says (p / 0)."""
        if all(p.probs is None or k == 0 for p, k in zip(proposals, ks)):
            return None
        V = logits.shape[-1]
        q = torch.zeros(len(proposals), K, V, dtype=torch.float32, device=logits.device)
        for b, (p, k) in enumerate(zip(proposals, ks)):
            if k == 0:
                continue
            if p.probs is None:
                drafted = torch.tensor(p.tokens[:k], dtype=torch.long, device=logits.device)
                q[b, torch.arange(len(drafted), device=logits.device), drafted] = 1.0
                continue
            if p.probs.shape[-1] != V:
                raise RuntimeError(f"draft probs width {p.probs.shape[-1]} != target logits {V}")
            q[b, :k] = p.probs[:k].to(q)
        return q

    @staticmethod
    def _chain_observation(b, k, d_t, logits, res, sampling, u_acc, q, guard,
                           span) -> Callable[[int], StepObservation]:
        sampled = not sampling.greedy

        def make(emitted: int) -> StepObservation:
            return StepObservation(
                d_t[b: b + 1, :k], logits[b: b + 1, : k + 1], res.row(b, k), sampling,
                u_acc[b: b + 1, :k] if sampled and u_acc is not None else None,
                q[b: b + 1, :k] if sampled and q is not None else None, emitted,
                guard=None if guard is None else guard[b: b + 1, :k],
                strict_span=None if span is None else torch.tensor([span[b][:k]], dtype=torch.bool).view(1, k))
        return make

    def _tree_step(self, tokens: list[int], parents: list[int]) -> list[int]:
        """One step with a draft tree (batch size 1): one target pass over root + all nodes
        (tree mask and tree position ids), verification along the tree, then only the
        accepted path stays in the cache."""

        r = self.rows[0]
        seq = r.seq
        tree = DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
        base = r.npos  # the positions cached before the root
        if isinstance(self.kv, SlotCache):  # static or captured: the tree at a step's shape
            ids, pos, block = tree_block(tree, seq.seq[-1], base, self.device)
            logits = self._step_forward(ids, None, pos, block=block).logits[0].float()  # [N+1, V]
        else:
            logits, _ = self._captured(lambda: tree_forward(self.model, self.kv.cache, tree, seq.seq[-1], base))
        N = len(tree)
        s = seq.sampling
        u_accept, u_sample = seq.uniforms(N)
        guard = span = None
        wanted = self.rule.relaxes or seq.observer is not None
        if self.guard.repeat_ngram and wanted:
            guard = torch.tensor(_tree_repeats(seq, tokens, parents), dtype=torch.bool)  # [N]
        if self.spans is not None and wanted:
            span = torch.tensor(seq.strict_spans_tree(tokens, parents), dtype=torch.bool)  # [N]
            guard = span.clone() if guard is None else guard | span
        if wanted and seq.strict_first > len(seq.out):
            first = torch.tensor(seq.strict_first_flags(tree.depth().tolist()), dtype=torch.bool)
            guard = first if guard is None else guard | first
        if wanted and seq.stop_tokens:
            # node i is judged by its parent's row of logits (the root's: row 0)
            judge = logits[tree.parents.to(logits.device) + 1]  # [N, V]
            stop = stop_positions(tree.tokens.view(1, N).to(logits.device), judge.unsqueeze(0),
                                  torch.tensor([seq.stop_tokens], dtype=torch.long))[0].cpu()
            guard = stop if guard is None else guard | stop
        res = verify_tree(tree, logits, rule=self.rule, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, u_accept=u_accept, u_sample=u_sample, guard=guard,
                          relax_left=seq.relax_left())
        path = [int(i) for i in res.path]
        n = len(path)
        depth = int(tree.depth().max())
        rows = [0] + [i + 1 for i in path]  # logits rows that decided something
        decided = rows[: min(n + 1, depth)]  # rows whose children were judged
        relaxable = int(res.relaxable[torch.tensor(decided, dtype=torch.long)].sum()) if decided else 0
        seq.stats.tree_nodes += N
        observation = None
        if seq.observer is not None:
            def observation(emitted: int) -> StepObservation:
                return StepObservation(
                    tree.tokens[path].view(1, n) if n else torch.zeros(1, 0, dtype=torch.long),
                    logits[rows].unsqueeze(0), res, s, None, None, emitted, tree=tree,
                    tree_logits=logits, tree_u_accept=u_accept, guard=guard, strict_span=span)
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
                             sum(res.relaxed), relaxable, observation, origin=origin)
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
        if self.step_kind != "eager" and self.tap is not None:
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


def _tree_repeats(seq: Sequence, tokens: list[int], parents: list[int]) -> list[bool]:
    """The loop guard's verdict for every node of a draft tree: its root path (the drafts
    ahead of it) and then the node, as a chain draft would be judged."""
    out = []
    for i in range(len(tokens)):
        path = [i]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        out.append(seq.repeats([tokens[j] for j in reversed(path)])[-1])
    return out
