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

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from marscli.config import DraftConfig, SamplingParams, VerifyConfig
from marscli.engine import GenerationResult, RecordFailure, Sequence, SpecEngine, StepObservation
from marscli.kvcache import new_cache

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
                 draft_cfg: DraftConfig, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        self.target = target
        self.model = target.model
        self.drafter_factory = drafter_factory
        # The single-record engine lends its prompt handling, eos set, theta, forward and CPU
        # fast path; the rows share its settings.
        self.single = SpecEngine(target, drafter_factory(), verify_cfg, draft_cfg)
        self.batch_size = batch_size
        self.device = target.device
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
        self._reset()

    # ------------------------------------------------------------------ prompts (as SpecEngine)

    def tokenize(self, req) -> list[int]:
        return self.single.tokenize(req)

    def fit_prompt(self, ids: list[int], **kw) -> tuple[list[int], int]:
        return self.single.fit_prompt(ids, **kw)

    # ------------------------------------------------------------------ the loop

    def run(self, items: Iterable[Any],
            prepare: Callable[[Any], tuple[list[int], SamplingParams]],
            observer_for: Callable[[Any], Callable[[StepObservation], None] | None] | None = None,
            ) -> Iterator[tuple[Any, GenerationResult | Exception]]:
        """Generate every item; yield (item, result) as rows finish.

        prepare(item) -> (prompt ids, sampling); a RecordFailure it raises is yielded as that
        item's result. A failure of a batched forward pass other than out-of-memory is
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
                        except RecordFailure as e:
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

    def _keep(self, keep: list[int]) -> None:
        """Keep only these batch rows (a finished row leaves at once)."""
        self.rows = [self.rows[b] for b in keep]
        self.kv.keep_rows(keep)

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
        seq = Sequence(self.single, self.drafter_factory(), ids, sampling, observer=observer)
        self._last_prefill = None
        if not seq.done and len(ids) > 1:
            # Prefilled alone, exactly as SpecEngine does: no padding ever enters a prompt pass.
            c = new_cache(self.model)
            self.single._forward(list(ids[:-1]), c, logits_to_keep=1)
            self._last_prefill = [(layer.keys, layer.values) for layer in c.layers]
        return _Row(item, ids, sampling, seq, len(ids) - 1)

    def _step(self) -> list[int]:
        """One speculative step for every active row; returns the rows that finished."""
        rows = self.rows
        B = len(rows)
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
        logits = self.kv.forward(ids, new_mask, pos).logits  # [B, K+1, V]
        self.peak_cache_bytes = max(self.peak_cache_bytes, self.kv.nbytes())
        assert logits.shape[:2] == (B, K + 1), tuple(logits.shape)
        finished = []
        for b, (r, (drafts, proposal)) in enumerate(zip(rows, plans)):
            k = len(drafts)
            n = r.seq.commit(drafts, proposal, logits[b: b + 1, : k + 1])
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
