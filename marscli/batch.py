"""Batched speculative decoding: many records decode together, each with its own acceptance.

Each record is a marscli.engine.Sequence: its own drafter, random generators, verification
and stopping, exactly the code SpecEngine runs for one record. What batching adds is the
target's forward pass, shared by all active rows, over one batched KV cache with holes:

- Every step each active row feeds [pending, d_1 .. d_k_b], right-padded to the step's
  largest k. After verification row b keeps 1 + n_b of its new slots; the rejected drafts and
  the padding stay in the cache but are masked out (2D attention mask 0) for good. Position
  ids are explicit per row: the number of valid tokens before the slot, as if the row ran
  alone. So a row's logits are those of its own sequence; only float summation order can
  differ from a single-row pass (see docs/engine.md, "Batching").
- A new record is prefilled alone (as SpecEngine does), then left-padded to the batch's cache
  length and appended as a new row; a finished row is dropped from the batch. Rows finish
  at different times and the next pending record takes the freed place (continuous refill).
- When holes make up too much of the cache, the cache is compacted: every row's valid slots
  are gathered to the right, with left padding.
- On CUDA out-of-memory the batch is halved and the affected records restart from scratch
  (their outputs are a function of their seeds, so a restart changes nothing).

Results are yielded as rows finish, not in input order: callers that need input order
(the CLI's ResultWriter) restore it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.drafters.base import AcceptanceTracker, CostModel, Proposal
from marscli.engine import GenerationResult, Sequence, SpecEngine, StepObservation
from marscli.kvcache import new_cache
from marscli.verify import sample_from, sampling_probs

#: Compact when the cache is longer than COMPACT_RATIO x the longest row's valid tokens
#: (plus COMPACT_SLACK slots, so short sequences are not compacted every step).
COMPACT_RATIO = 1.5
COMPACT_SLACK = 32


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


class BatchEngine:
    """Speculative generation of many records at once over one batched target cache.

    target: a LoadedModel (as SpecEngine). drafter_factory: () -> a new Drafter; each row gets
    its own, so adaptive draft lengths stay per record. batch_size: rows decoded together.
    """

    def __init__(self, target, drafter_factory: Callable[[], Any], verify_cfg: VerifyConfig,
                 draft_cfg: DraftConfig, batch_size: int, batched_drafter: BatchedModelDrafter | None = None):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.target = target
        self.model = target.model
        self.drafter_factory = drafter_factory
        # The single-record engine lends its prompt handling, eos set, theta, forward and CPU
        # fast path; the rows share its settings.
        self.single = SpecEngine(target, drafter_factory(), verify_cfg, draft_cfg)
        if self.single.tree is not None:
            raise ValueError("draft trees run one record at a time (batch size 1); "
                             "use chain drafting to batch")
        self.batch_size = batch_size
        self.device = target.device
        # A draft model that drafts for all rows in one forward pass per draft position; its
        # rows follow the target's (same order, added and dropped together).
        self.bd = batched_drafter
        tok = target.tokenizer
        self.pad_id = next((t for t in (tok.pad_token_id, tok.eos_token_id) if t is not None), 0)
        sliding = [i for i, layer in enumerate(new_cache(self.model).layers)
                   if getattr(layer, "is_sliding", False)]
        if sliding and batch_size > 1:
            raise ValueError(
                "batched decoding does not support models with sliding-window attention layers "
                f"(layers {sliding[:4]}...); use --batch-size 1"
            )
        self.oom_retries = 0  # how many times the batch was halved (for reports and tests)
        self.peak_cache_bytes = 0  # largest target KV cache seen (holes and padding included)
        self.prefill_seconds = 0.0  # time spent prefilling new records (one at a time)
        self._reset()

    # ------------------------------------------------------------------ prompts (as SpecEngine)

    def tokenize(self, req) -> list[int]:
        return self.single.tokenize(req)

    def fit_prompt(self, ids: list[int], **kw) -> tuple[list[int], int]:
        return self.single.fit_prompt(ids, **kw)

    def encode(self, req) -> list[int]:
        return self.single.encode(req)

    def generate_ids(self, prompt_ids: list[int], sampling: SamplingParams,
                     observer: Callable[[StepObservation], None] | None = None) -> GenerationResult:
        """One record alone (a batch of one)."""
        for _, res in self.run([None], lambda _: (prompt_ids, sampling),
                               observer_for=(lambda _: observer) if observer else None):
            if isinstance(res, BaseException):
                raise res
            return res
        raise AssertionError("run() yielded nothing")

    # ------------------------------------------------------------------ the loop

    def run(self, items: Iterable[Any],
            prepare: Callable[[Any], tuple[list[int], SamplingParams]],
            observer_for: Callable[[Any], Callable[[StepObservation], None] | None] | None = None,
            ) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        """Generate every item; yield (item, result) as rows finish.

        prepare(item) -> (prompt ids, sampling); an exception it raises (a RecordFailure...)
        is yielded as that item's result. A failure of a batched forward pass other than out-of-memory is
        yielded for every row in the batch. observer_for(item) -> an observer for that
        record's steps ([1, k_b] slices, like SpecEngine's); it is called again when an
        out-of-memory error restarts the record, so a fresh observer can drop the aborted
        steps.
        """
        source = iter(items)
        retry: deque[tuple[Any, list[int], SamplingParams]] = deque()
        self._reset()
        with torch.inference_mode():
            while True:
                # Refill: pending records take the free places (restarted ones first).
                while len(self.rows) < self.batch_size:
                    if retry:
                        item, ids, sampling = retry.popleft()
                    else:
                        try:
                            item = next(source)
                        except StopIteration:
                            break
                        try:
                            ids, sampling = prepare(item)
                        except Exception as e:  # noqa: BLE001 - a RecordFailure or a tokenizer fault: this record only
                            yield item, e
                            continue
                    try:
                        row = self._start_row(item, ids, sampling,
                                               observer_for(item) if observer_for else None)
                    except oom_errors() as e:
                        if self._halve(e):
                            retry.appendleft((item, ids, sampling))
                            for r in reversed(self._evict_all()):
                                retry.appendleft((r.item, r.ids, r.sampling))
                            continue
                        yield item, e
                        continue
                    except Exception as e:  # noqa: BLE001 - one record's failure ends only it
                        yield item, e
                        continue
                    if row.seq.done:  # no room for a single new token
                        yield item, row.seq.result()
                        continue
                    self.kv.add_row(self._last_prefill, row.npos)
                    self.rows.append(row)
                    if self.bd is not None:
                        self.bd.add(row.seq.drafter, self._last_draft_prefill, row.ids)
                if not self.rows:
                    return
                try:
                    finished = self._step()
                except oom_errors() as e:
                    if self._halve(e):
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
                    keep = [b for b in range(len(self.rows)) if b not in finished]
                    self._keep(keep)
                    for r in done_rows:
                        yield r.item, r.seq.result()

    # ------------------------------------------------------------------ internals

    def _reset(self) -> None:
        self.rows: list[_Row] = []
        self.kv = HoleCache(self.model, self.device)  # the target's cache, one row per record
        self._last_prefill = None
        self._last_draft_prefill = None
        if getattr(self, "bd", None) is not None:
            self.bd.reset()

    def _keep(self, keep: list[int]) -> None:
        """Keep only these batch rows (a finished row leaves at once)."""
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep_rows(keep)
        if self.bd is not None:
            self.bd.keep(keep)

    def _halve(self, err: BaseException) -> bool:
        """Halve the batch after an out-of-memory error; False if it is already 1."""
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

    def _start_row(self, item, ids: list[int], sampling: SamplingParams, observer) -> _Row:
        t0 = time.perf_counter()
        try:
            return self._prefill_row(item, ids, sampling, observer)
        finally:
            self.prefill_seconds += time.perf_counter() - t0

    def _prefill_row(self, item, ids: list[int], sampling: SamplingParams, observer) -> _Row:
        drafter = self.bd.new_handle() if self.bd is not None else self.drafter_factory()
        seq = Sequence(self.single, drafter, ids, sampling, observer=observer)
        self._last_prefill = self._last_draft_prefill = None
        if self.bd is not None and not seq.done:
            self._last_draft_prefill = self.bd.prefill(ids)
        if not seq.done and len(ids) > 1:
            # Prefilled alone, exactly as SpecEngine does: no padding ever enters a prompt pass.
            c = new_cache(self.model)
            self.single._forward(list(ids[:-1]), c, logits_to_keep=1)
            seq.observe_prefill(self.single.last_features)
            self._last_prefill = [(layer.keys, layer.values) for layer in c.layers]
        return _Row(item, ids, sampling, seq, len(ids) - 1)

    def _step(self) -> list[int]:
        """One speculative step for every active row; returns the rows that finished."""
        rows = self.rows
        B = len(rows)
        if self.bd is not None:
            self.bd.propose_all([r.seq.seq for r in rows], [r.seq.k_cap() for r in rows])
        plans = [r.seq.propose() for r in rows]
        K = max(len(d) for d, _ in plans)
        ids = torch.full((B, K + 1), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(B, K + 1, dtype=torch.long)
        for b, (r, (drafts, _)) in enumerate(zip(rows, plans)):
            ids[b, : 1 + len(drafts)] = torch.tensor([r.seq.seq[-1]] + drafts)
            new_mask[b, : 1 + len(drafts)] = 1
        npos = torch.tensor([r.npos for r in rows], dtype=torch.long)
        pos = npos[:, None] + torch.arange(K + 1)[None, :]  # [B, K+1]
        ids, new_mask, pos = ids.to(self.device), new_mask.to(self.device), pos.to(self.device)
        with self.single.capture():  # the target features, for drafters that read them
            logits = self.kv.forward(ids, new_mask, pos).logits  # [B, K+1, V]
        features = self.single.last_features  # [B, K+1, F] or None
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
        assert logits.shape[:2] == (B, K + 1), tuple(logits.shape)
        finished = []
        for b, (r, (drafts, proposal)) in enumerate(zip(rows, plans)):
            k = len(drafts)
            if features is None:
                n = r.seq.commit(drafts, proposal, logits[b: b + 1, : k + 1])
            else:
                n = r.seq.commit(drafts, proposal, logits[b: b + 1, : k + 1], features=features[b: b + 1, : k + 1])
            new_mask[b, 1 + n:] = 0
            r.npos += 1 + n
            if r.seq.done:
                finished.append(b)
        self.kv.commit(new_mask)
        if not finished:
            self.kv.trim()
        return finished


class HoleCache:
    """A batched KV cache whose rows keep only some of their slots: mask [B, T] says which
    (1: a token of that row's sequence, in order; 0: padding or a rejected draft)."""

    def __init__(self, model, device):
        self.model = model
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, T]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers() for t in (layer.keys, layer.values))

    def forward(self, ids: torch.Tensor, new_mask: torch.Tensor, pos: torch.Tensor, **kw):
        """Run the model on ids [B, S] (new_mask [B, S]: 1 for real tokens, position ids pos
        [B, S]) over the cache; the new slots stay in the cache until commit()."""
        attn = torch.cat([self.mask, new_mask], 1)  # [B, T + S]
        return self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                          past_key_values=self.cache, use_cache=True, **kw)

    def commit(self, new_mask: torch.Tensor) -> None:
        """Record which of the last forward's new slots each row keeps ([B, S])."""
        self.mask = torch.cat([self.mask, new_mask], 1)

    def truncate_row(self, b: int, keep: int) -> None:
        """Mask out row b's valid slots beyond its first `keep` (a per-row rollback)."""
        valid = self.mask[b].nonzero().flatten()
        if keep < valid.numel():
            self.mask[b, valid[keep:]] = 0

    def layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)
                and layer.keys is not None and layer.keys.numel() > 0]

    def add_row(self, kv: list[tuple[torch.Tensor, torch.Tensor]] | None, L: int) -> None:
        """Append a row whose L cached slots are kv (per layer [1, H, L, D]; None if L == 0),
        left-padding it or the batch to a common cache length."""
        T = self.mask.shape[1]
        new_t = max(T, L)
        B = self.mask.shape[0]
        batch_layers = self.layers()
        have_batch_kv = bool(batch_layers) and B > 0
        if new_t > T and have_batch_kv:
            for layer in batch_layers:
                layer.keys = _left_pad(layer.keys, new_t)
                layer.values = _left_pad(layer.values, new_t)
        mask = _left_pad_mask(self.mask, new_t)
        row_mask = torch.zeros(1, new_t, dtype=torch.long, device=self.device)
        if L:
            row_mask[0, new_t - L:] = 1
        self.mask = torch.cat([mask, row_mask], 0)
        if new_t == 0:
            return
        if kv is None:  # the row has no cached tokens: zeros, masked out
            ref = batch_layers
            for layer in ref:
                z = layer.keys.new_zeros((1,) + layer.keys.shape[1:])
                layer.keys = torch.cat([layer.keys, z], 0)
                layer.values = torch.cat([layer.values, layer.values.new_zeros((1,) + layer.values.shape[1:])], 0)
            return
        if not have_batch_kv:
            # Empty batch (or rows without cached tokens): the new row's cache is the start.
            for layer, (k, v) in zip(self.cache.layers, kv):
                k, v = _left_pad(k, new_t), _left_pad(v, new_t)
                if B:  # the rows before it had nothing cached: zeros, masked out
                    k = torch.cat([k.new_zeros((B,) + k.shape[1:]), k], 0)
                    v = torch.cat([v.new_zeros((B,) + v.shape[1:]), v], 0)
                if not layer.is_initialized:
                    layer.lazy_initialization(k, v)
                layer.keys, layer.values = k, v
        else:
            for layer, (k, v) in zip(self.cache.layers, kv):
                layer.keys = torch.cat([layer.keys, _left_pad(k, new_t)], 0)
                layer.values = torch.cat([layer.values, _left_pad(v, new_t)], 0)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows (in this order)."""
        if not keep:
            self.reset()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, idx)
        for layer in self.layers():
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)
        self.trim()

    def trim(self) -> None:
        """Drop slots no row uses at the left and right ends; compact when holes dominate."""
        T = self.mask.shape[1]
        if T == 0:
            return
        used = self.mask.any(0).nonzero()
        if used.numel() == 0:
            lo, hi = T, T
        else:
            lo, hi = int(used[0]), int(used[-1]) + 1
        if hi < T or lo > 0:
            self.mask = self.mask[:, lo:hi]
            for layer in self.layers():
                layer.keys = layer.keys[:, :, lo:hi]
                layer.values = layer.values[:, :, lo:hi]
        longest = int(self.mask.sum(1).max()) if self.mask.numel() else 0
        if self.mask.shape[1] > COMPACT_RATIO * longest + COMPACT_SLACK:
            self.compact()

    def compact(self) -> None:
        """Gather each row's valid slots to the right end (left padding); same order."""
        counts = self.mask.sum(1)  # [B]
        new_t = int(counts.max())
        B, T = self.mask.shape
        # For each row, source index of each destination slot (padding reads slot 0, masked).
        order = torch.sort(self.mask, dim=1, stable=True).indices  # invalid first, then valid in order
        index = order[:, T - new_t:]  # [B, new_t]
        self.mask = self.mask.gather(1, index)
        for layer in self.layers():
            H, D = layer.keys.shape[1], layer.keys.shape[3]
            gi = index[:, None, :, None].expand(B, H, new_t, D)
            layer.keys = layer.keys.gather(2, gi)
            layer.values = layer.values.gather(2, index[:, None, :, None].expand(B, H, new_t, layer.values.shape[3]))


def batched_drafter_for(draft_cfg: DraftConfig, target, draft_model) -> BatchedModelDrafter | None:
    """The batched form of the drafter build_drafter makes, where there is one (a draft
    model without sliding-window layers, an EAGLE-3 head drafting chains); None for drafters
    that run per row (ngram, none, a windowed draft model: BatchEngine then gives each row
    its own drafter)."""
    from marscli.engine import build_drafter

    if draft_cfg.kind == "eagle3" and not draft_cfg.tree:
        from marscli.drafters.eagle3 import BatchedEagle3Drafter

        one = build_drafter(draft_cfg, target, draft_model)  # its cost model and vocabulary width
        return BatchedEagle3Drafter(one.head, one.k_max, vocab_size=one.vocab_size, cost=one.cost,
                                    adaptive=one.adaptive)
    if draft_cfg.kind != "model":
        return None
    if any(getattr(layer, "is_sliding", False) for layer in new_cache(draft_model.model).layers):
        return None  # windowed layers cannot be rolled back per row: a ModelDrafter per row
    md = build_drafter(draft_cfg, target, draft_model)  # its cost model and vocabulary width
    return BatchedModelDrafter(md.model, md.k_max, cost=md.cost, adaptive=md.adaptive,
                               vocab_size=md.vocab_size)


class _RowDraft:
    """One row's handle on a BatchedModelDrafter: the Drafter interface engine.Sequence
    calls. Its proposal was computed for all rows at once just before."""

    name = "model"

    def __init__(self, owner: BatchedModelDrafter):
        self.owner = owner
        self.next: Proposal | None = None
        self.cached: list[int] = []  # tokens whose keys/values are valid in the row's cache
        self.start([])

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              generator: torch.Generator | None = None) -> None:
        self.sampling = sampling or SamplingParams()
        self.generator = generator
        self.tracker = AcceptanceTracker(self.owner.k_max, self.owner.cost, adaptive=self.owner.adaptive)
        self.cached = []

    def propose(self, seq: list[int], k_max: int) -> Proposal:
        assert self.next is not None, "BatchedModelDrafter.propose_all must run first"
        proposal, self.next = self.next, None
        return proposal

    def accepted(self, proposed: int, accepted: int, seq: list[int]) -> None:
        self.tracker.update(proposed, accepted)


class BatchedModelDrafter:
    """marscli.drafters.model.ModelDrafter for a whole batch: one draft-model forward per
    draft position for all rows, over a HoleCache of its own.

    Each row drafts what a ModelDrafter would for it alone: the same choice of k (its own
    AcceptanceTracker), the same greedy argmax or the same draws from its own generator;
    only the float summation order of the draft model's batched pass may differ.
    """

    def __init__(self, model, k_max: int, *, cost: CostModel | None = None, adaptive: bool = True,
                 vocab_size: int | None = None):
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        self.k_max = k_max
        self.cost = cost or CostModel()
        self.adaptive = adaptive
        self.vocab_size = vocab_size
        tok = getattr(model.config, "pad_token_id", None)
        self.pad_id = tok if isinstance(tok, int) else 0
        self.reset()

    def reset(self) -> None:
        self.kv = HoleCache(self.model, self.device)
        self.rows: list[_RowDraft] = []

    def new_handle(self) -> _RowDraft:
        return _RowDraft(self)

    def prefill(self, ids: list[int]):
        """The draft cache of a new row's prompt but its last token (run alone)."""
        if len(ids) <= 1:
            return None
        c = new_cache(self.model)
        x = torch.tensor([ids[:-1]], dtype=torch.long, device=self.device)
        self.model(input_ids=x, past_key_values=c, use_cache=True, logits_to_keep=1)
        return [(layer.keys, layer.values) for layer in c.layers]

    def add(self, handle: _RowDraft, kv, ids: list[int]) -> None:
        """Append a row whose prompt `ids` but the last token were prefilled into kv."""
        handle.cached = list(ids[:-1]) if kv is not None else []
        self.kv.add_row(kv, len(handle.cached))
        self.rows.append(handle)

    def keep(self, keep: list[int]) -> None:
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep_rows(keep)

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        if self.vocab_size is None or logits.shape[-1] == self.vocab_size:
            return logits
        if logits.shape[-1] > self.vocab_size:  # padded embedding rows never get drafted
            return logits[: self.vocab_size]
        pad = logits.new_full((self.vocab_size - logits.shape[-1],), float("-inf"))
        return torch.cat([logits, pad])

    def _feed(self, feeds: list[list[int]]) -> torch.Tensor:
        """One forward: row b appends feeds[b] (possibly none) -> logits [B, S, V_draft]."""
        B = len(self.rows)
        S = max(len(f) for f in feeds)
        ids = torch.full((B, S), self.pad_id, dtype=torch.long)
        new_mask = torch.zeros(B, S, dtype=torch.long)
        for b, f in enumerate(feeds):
            if f:
                ids[b, : len(f)] = torch.tensor(f)
                new_mask[b, : len(f)] = 1
        npos = torch.tensor([len(h.cached) for h in self.rows], dtype=torch.long)
        pos = npos[:, None] + torch.arange(S)[None, :]
        ids, new_mask, pos = ids.to(self.device), new_mask.to(self.device), pos.to(self.device)
        logits = self.kv.forward(ids, new_mask, pos).logits  # [B, S, V_draft]
        self.kv.commit(new_mask)
        for h, f in zip(self.rows, feeds):
            h.cached.extend(f)
        return logits

    @torch.inference_mode()
    def propose_all(self, seqs: list[list[int]], k_caps: list[int]) -> None:
        """Compute every row's next proposal (left in its handle for Sequence.propose)."""
        rows = self.rows
        assert len(seqs) == len(k_caps) == len(rows)
        ks = []
        catch: list[list[int]] = []
        for b, (h, seq, cap) in enumerate(zip(rows, seqs, k_caps)):
            k = h.tracker.choose_k(cap) if cap > 0 else 0
            ks.append(k)
            h.next = Proposal([])
            if k <= 0:
                catch.append([])
                continue
            # Bring the row's cache up to its committed sequence (at least the last token is new).
            common = 0
            for a, t in zip(h.cached, seq):
                if a != t:
                    break
                common += 1
            common = min(common, len(seq) - 1)
            if common < len(h.cached):
                self.kv.truncate_row(b, common)
                del h.cached[common:]
            catch.append(list(seq[common:]))
        if not any(ks):
            self.kv.trim()
            return
        logits = self._feed(catch)
        last = [self._fit_vocab(logits[b, len(c) - 1]) if c else None for b, c in enumerate(catch)]
        tokens: list[list[int]] = [[] for _ in rows]
        probs: list[list[torch.Tensor]] = [[] for _ in rows]
        for i in range(max(ks)):
            feeds: list[list[int]] = [[] for _ in rows]
            for b, (h, k) in enumerate(zip(rows, ks)):
                if i >= k:
                    continue
                s = h.sampling
                if s.greedy:
                    tok = int(last[b].argmax())
                else:
                    q = sampling_probs(last[b].unsqueeze(0), s.temperature, s.top_k, s.top_p)  # [1, V]
                    u = torch.rand(1, generator=h.generator)
                    tok = int(sample_from(q, u)[0])
                    probs[b].append(q[0])
                tokens[b].append(tok)
                if i + 1 < k:
                    feeds[b] = [tok]
            if any(feeds):
                logits = self._feed(feeds)
                for b, f in enumerate(feeds):
                    if f:
                        last[b] = self._fit_vocab(logits[b, 0])
        for b, h in enumerate(rows):
            if ks[b] > 0:
                h.next = Proposal(tokens[b], torch.stack(probs[b]) if probs[b] else None)
        self.kv.trim()


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad [B, H, T, D] with zeros along T to `length`."""
    extra = length - x.shape[2]
    if extra <= 0:
        return x
    return torch.cat([x.new_zeros(x.shape[:2] + (extra,) + x.shape[3:]), x], 2)


def _left_pad_mask(m: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - m.shape[1]
    if extra <= 0:
        return m
    return torch.cat([m.new_zeros(m.shape[0], extra), m], 1)
