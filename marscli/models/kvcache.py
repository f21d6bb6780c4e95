"""Every KV cache of marscli: growing layers, rollback, tree compaction, and the engine's
batched cache with holes (HoleCache)."""

from __future__ import annotations

import functools
import inspect

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A step input built on the host, on the device: on CUDA through pinned memory and a
    non-blocking copy (the host tensor stays the host's to read and change)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=None)
def _cache_keyword(forward) -> str:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params and "past_key_values" not in params else "past_key_values"


def cache_kw(model, cache) -> dict:
    """The keyword that hands `cache` to `model`'s forward: ``cache`` from transformers 5.24
    (which deprecates ``past_key_values`` with a warning on every run), ``past_key_values``
    before. Read once per forward function, not on every forward pass."""
    forward = model.forward
    return {_cache_keyword(getattr(forward, "__func__", forward)): cache}


#: Spare capacity of a growing layer: room for GROW x the positions it holds, at least
#: GROW_MIN more.
GROW = 1.25
GROW_MIN = 64


class GrowingLayer(DynamicLayer):
    """A DynamicLayer that appends new positions into spare capacity instead of `torch.cat`.

    transformers' DynamicLayer copies the whole layer on every forward (cat of old and new);
    speculative decoding forwards once per step, so a 600-token batch-8 cache was copied
    ~60 times a step (all layers, keys and values). Here the layer's keys/values are views of
    a buffer with room to spare; a view that was cut shorter (crop, rollback, a trimmed
    batch) still ends inside the buffer, so the next update writes after its end in place.
    Anything else that replaces keys/values (index_select, padding, gather) simply gets a new
    buffer at the next update: the class never needs to know who changed what.

    The buffer may also hold more batch rows than the view (``batch_capacity``: a batched
    cache that a finished row left and a new row will join): the view is then its first
    rows, and HoleCache moves, drops and adds rows inside the buffer instead of copying the
    whole cache twice (once to select rows, once more to regrow at the next append).
    """

    #: Batch rows a new buffer is allocated for (at least the rows it must hold).
    batch_capacity = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        rows = self.batch_capacity
        self.keys, self._kbuf = _append(self.keys, getattr(self, "_kbuf", None), key_states, rows)
        self.values, self._vbuf = _append(self.values, getattr(self, "_vbuf", None), value_states, rows)
        return self.keys, self.values

    def views(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """(key buffer, value buffer, first slot) when keys and values are views of the first
        rows of this layer's buffers at the same slots; None otherwise."""
        kbuf, vbuf = getattr(self, "_kbuf", None), getattr(self, "_vbuf", None)
        if self.keys is None or self.values is None or self.keys.numel() == 0:
            return None
        ks, vs = _start_in(kbuf, self.keys), _start_in(vbuf, self.values)
        if ks is None or ks != vs or self.keys.shape != self.values.shape:
            return None
        return kbuf, vbuf, ks

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        super().reset()

    def adopt(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int) -> None:
        """Hold the first `length` positions of buffers kbuf, vbuf [B, H, cap, D] (the
        rest is room to append into)."""
        if not self.is_initialized:
            self.lazy_initialization(kbuf[:, :, :length], vbuf[:, :, :length])
        self._kbuf, self._vbuf = kbuf, vbuf
        self.keys, self.values = kbuf[:, :, :length], vbuf[:, :, :length]


def _start_in(buf: torch.Tensor | None, cur: torch.Tensor) -> int | None:
    """The slot where view `cur` [B', H, T, D] begins inside `buf` [B, H, cap, D] (its first
    B' <= B rows), or None if `cur` is not such a view (a copy, a different layout, rows
    that do not start at the buffer's first)."""
    if buf is None or cur.dim() != 4 or cur.shape[0] > buf.shape[0] or cur.shape[1] != buf.shape[1] \
            or cur.shape[3] != buf.shape[3] or cur.stride() != buf.stride() or cur.dtype != buf.dtype:
        return None
    if cur.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    offset = cur.storage_offset() - buf.storage_offset()
    step = buf.stride(2)
    if offset < 0 or offset % step or offset >= buf.stride(1):
        return None
    start = offset // step
    return start if start + cur.shape[2] <= buf.shape[2] else None


def _append(cur: torch.Tensor | None, buf: torch.Tensor | None, new: torch.Tensor, rows: int = 0):
    """(cur followed by new, as a view of a buffer; that buffer). A new buffer has room for
    at least `rows` batch rows."""
    B, S = new.shape[0], new.shape[2]
    T = 0 if cur is None or cur.numel() == 0 else cur.shape[2]
    start = _start_in(buf, cur) if T else None
    if start is not None and start + T + S <= buf.shape[2]:
        buf[:B, :, start + T: start + T + S] = new
        return buf[:B, :, start: start + T + S], buf
    cap = max(T + S + GROW_MIN, int((T + S) * GROW))
    fresh = new.new_empty(max(B, rows), new.shape[1], cap, new.shape[3])
    if T:
        fresh[:B, :, :T] = cur
    fresh[:B, :, T: T + S] = new
    return fresh[:B, :, : T + S], fresh


def new_cache(model) -> DynamicCache:
    """An empty cache laid out for `model`: full-attention layers grow in place
    (GrowingLayer); sliding-window layers record their past so that they too can be rolled
    back."""
    cache = DynamicCache(config=model.config)
    layers = getattr(cache, "layers", [])
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer:
            layers[i] = GrowingLayer()
        elif hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


def sliding_layers(model) -> list[int]:
    """Indices of the cache layers of `model` that keep a sliding window (they cannot hold
    holes or be rolled back per batch row)."""
    return [i for i, layer in enumerate(new_cache(model).layers) if getattr(layer, "is_sliding", False)]


def rollback(cache: DynamicCache, length: int) -> None:
    """Keep only the first `length` positions of every layer."""
    current = cache.get_seq_length()
    assert length <= current, f"cannot roll a cache of {current} positions forward to {length}"
    # transformers >= 5 takes a negative count to remove. crop(0) is not skipped: sliding-window
    # layers that record their past trim back to their window only when cropped.
    cache.crop(length - current)


def check_plain_layers(cache) -> None:
    """Raise ValueError unless every layer is a plain (growing) DynamicLayer: subclasses keep
    extra per-position state (sliding windows, indexer keys, quantized residuals) that a
    gather of keys/values would leave out of step."""
    for i, layer in enumerate(cache.layers):
        if type(layer) not in (DynamicLayer, GrowingLayer):
            raise ValueError(
                f"draft trees need a plain DynamicCache; layer {i} is a {type(layer).__name__}"
            )


def compact_cache(cache, past_len: int, path: list[int]) -> None:
    """After a tree step: keep the past, the root and the accepted path's nodes (path order);
    drop the rest.

    Afterwards every layer holds past_len + 1 + len(path) positions, contiguous, as if root and
    path had been fed as a chain (their keys carry the rotary positions past_len + depth, which
    are exactly the chain positions along a path).
    """
    check_plain_layers(cache)
    # In place, so inference mode: the engine's cache tensors are inference tensors, which
    # refuse in-place writes outside it.
    with torch.inference_mode():
        _compact_path(cache, past_len, path)


def _compact_path(cache, past_len: int, path: list[int]) -> None:
    start = past_len + 1  # first tree node's slot
    k = len(path)
    # A path is root-to-leaf, so its indices increase; prefix paths (0, 1, ..., k-1) need only
    # the crop.
    assert all(a < b for a, b in zip(path, path[1:])), f"path {path} is not increasing"
    for layer in cache.layers:
        if not layer.is_initialized:
            continue  # KV-sharing layers hold nothing
        total = layer.keys.shape[-2]
        assert total >= start and all(0 <= i < total - start for i in path), (
            f"cache layer of {total} positions cannot hold path {path} after {start}"
        )
        if path != list(range(k)):
            src = torch.tensor(path, dtype=torch.long, device=layer.keys.device) + start
            # In place, O(len(path)) instead of copying the whole cache: the gather copies the
            # path's entries before the (overlapping) write.
            layer.keys[..., start:start + k, :] = layer.keys[..., src, :]
            layer.values[..., start:start + k, :] = layer.values[..., src, :]
        # A view: a growing layer appends after it in place.
        layer.keys = layer.keys[..., : start + k, :]
        layer.values = layer.values[..., : start + k, :]


# --------------------------------------------------------------------------------------------
# The engine's cache: one row per record


#: Compact when the cache is longer than COMPACT_RATIO x the longest row's valid tokens
#: (plus COMPACT_SLACK slots, so short sequences are not compacted every step).
COMPACT_RATIO = 1.5
COMPACT_SLACK = 32


class HoleCache:
    """A model's KV cache for a batch of records, one row each.

    masked (batch size > 1): a batched cache whose rows keep only some of their slots:
    ``mask`` [B, T] says which (1: a token of that row's sequence, in order; 0: padding or a
    rejected draft). Every forward passes that mask and explicit per-row position ids.

    contiguous (batch size 1): at most one row and never a hole: the drafts a step rejects are
    at the end, so they are rolled back (cropped) instead of masked, and a forward is the plain
    single-sequence call (no mask, no position ids). This is also what keeps sliding-window
    layers, which record their past only to be cropped, exact at batch size 1.
    """

    def __init__(self, model, device, *, masked: bool, batch_capacity: int = 0):
        self.model = model
        self.device = device
        self.masked = masked
        self.batch_capacity = batch_capacity if masked else 0
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        for layer in self.cache.layers:
            if isinstance(layer, GrowingLayer):  # room for the whole batch: rows join in place
                layer.batch_capacity = self.batch_capacity
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)  # [B, T]

    def clear_rows(self) -> None:
        """No row (as SlotCache.clear_rows; a hole cache keeps nothing worth keeping)."""
        self.reset()

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers() for t in (layer.keys, layer.values))

    def layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)
                and layer.keys is not None and layer.keys.numel() > 0]

    # ------------------------------------------------------------------ forward and commit

    def forward(self, ids: torch.Tensor, new_mask: torch.Tensor, pos: torch.Tensor, **kw):
        """Run the model on ids [B, S] (new_mask [B, S]: 1 for real tokens, position ids pos
        [B, S]) over the cache; the new slots stay in the cache until commit()."""
        if not self.masked:
            assert ids.shape[0] == 1 and bool(new_mask.all()), "a contiguous cache runs one unpadded row"
            return self.model(input_ids=ids, **cache_kw(self.model, self.cache), use_cache=True, **kw)
        attn = torch.cat([self.mask, new_mask], 1)  # [B, T + S]
        return self.model(input_ids=ids, attention_mask=attn, position_ids=pos,
                          **cache_kw(self.model, self.cache), use_cache=True, **kw)

    def commit(self, new_mask: torch.Tensor, kept: list[int] | None = None) -> None:
        """Record which of the last forward's new slots each row keeps ([B, S]; kept, the
        per-row counts, is SlotCache's shortcut and not read here)."""
        if not self.masked:
            drop = int(new_mask.shape[1] - new_mask.sum())
            rollback(self.cache, self.cache.get_seq_length() - drop)
            new_mask = new_mask[:, : new_mask.shape[1] - drop]
        self.mask = torch.cat([self.mask, new_mask.to(self.mask.device)], 1)

    def append_kept(self, n: int) -> None:
        """The cache (one row) grew by n slots that all stay (after a tree step's compaction)."""
        assert not self.masked, "trees run on a contiguous cache"
        self.mask = torch.cat([self.mask, self.mask.new_ones(1, n)], 1)

    def keep_path(self, b: int, path: list[int]) -> None:
        """After a tree forward (marscli.engine.tree_forward) over the one row: keep the root
        and the accepted path's nodes (compact_cache), as SlotCache.keep_path does."""
        assert not self.masked and b == 0, "trees run on a contiguous cache"
        compact_cache(self.cache, self.mask.shape[1], path)
        self.append_kept(1 + len(path))

    def truncate_row(self, b: int, keep: int) -> None:
        """Mask out row b's valid slots beyond its first `keep` (a per-row rollback)."""
        if not self.masked:
            rollback(self.cache, keep)
            self.mask = self.mask[:, :keep]
            return
        valid = self.mask[b].nonzero().flatten()
        if keep < valid.numel():
            self.mask[b, valid[keep:]] = 0

    # ------------------------------------------------------------------ rows

    def add_prefilled(self, ids: list[int], run=None, *, past=None) -> torch.Tensor | None:
        """Append a row for a record whose cached tokens are `ids` (a prompt, or a prompt but
        its pending last token), prefilled alone, so no padding ever enters the pass (batched
        joins go through marscli.models.prefill and ``add_rows``). past: (m, keys/values per
        layer [1, H, m, D]) already computed for the m tokens before ids (a cached prefix;
        copied). run(forward) wraps the model call (the engine captures target features
        there). Returns the logits [V] at the last of ids on the contiguous cache (None
        when ids is empty, and on a masked cache)."""
        run = run or (lambda f: f())
        m = 0
        if not self.masked:
            assert self.rows == 0, "a contiguous cache holds one row"
            if past is not None and past[0]:
                m, kv = past
                self.cache = new_cache(self.model)
                for layer, pair in zip(self.cache.layers, kv):
                    if pair is not None:
                        _hold_copy(layer, pair, len(ids))
            logits = None
            if ids:
                x = torch.tensor([ids], dtype=torch.long, device=self.device)
                logits = run(lambda: self.model(input_ids=x, **cache_kw(self.model, self.cache), use_cache=True,
                                                logits_to_keep=1)).logits[0, -1]
            self.mask = torch.ones(1, m + len(ids), dtype=torch.long, device=self.device)
            return logits
        assert past is None, "a masked cache takes cached prefixes through add_rows"
        kv = None
        if ids:
            c = new_cache(self.model)
            x = torch.tensor([ids], dtype=torch.long, device=self.device)
            run(lambda: self.model(input_ids=x, **cache_kw(self.model, c), use_cache=True, logits_to_keep=1))
            kv = [(layer.keys, layer.values) for layer in c.layers]
        self.add_rows([(kv, len(ids))])

    def row_kv(self, length: int) -> list:
        """The one row's first `length` positions per layer ([1, H, length, D] views; None
        for a layer that holds nothing) of a contiguous cache."""
        assert not self.masked and self.rows == 1
        return [(layer.keys[:, :, :length], layer.values[:, :, :length])
                if layer.is_initialized and layer.keys is not None and layer.keys.numel() else None
                for layer in self.cache.layers]

    def add_row(self, kv: list[tuple[torch.Tensor, torch.Tensor]] | None, L: int) -> None:
        """Append a row whose L cached slots are kv (per layer [1, H, L, D]; None if L == 0)."""
        self.add_rows([(kv, L)])

    def add_rows(self, rows: list[tuple[list | None, int]]) -> None:
        """Append rows, each (kv, L): its L cached slots per layer ([1, H, L, D], None for a
        layer that holds nothing; kv None when L == 0), right-aligned at the batch's cache
        length (left padding, masked out; the batch is left-padded instead when a row is
        longer). Rows are written into the layer's buffer when it has room for them (a
        growing layer's buffer holds the batch's capacity), else one new buffer for the
        batch's capacity is made: the batch is copied at most once per join."""
        assert self.masked, "only a masked cache takes rows of other lengths"
        n = len(rows)
        B, T = self.mask.shape
        new_t = max([T] + [L for _, L in rows])
        added = torch.zeros(n, new_t, dtype=torch.long, device=self.device)
        for j, (_, L) in enumerate(rows):
            if L:
                added[j, new_t - L:] = 1
        self.mask = torch.cat([_left_pad_mask(self.mask, new_t), added], 0)
        if new_t == 0:
            return
        ref = next((kv for kv, L in rows if L), None)
        for li, layer in enumerate(self.cache.layers):
            cur = None
            if B and T and layer.is_initialized and layer.keys is not None and layer.keys.numel():
                cur = (layer.keys, layer.values)
            proto = cur if cur is not None else (ref[li] if ref is not None else None)
            if proto is None:
                continue  # nothing cached in this layer (KV sharing), or nowhere yet
            pk, pv = proto
            got = layer.views() if isinstance(layer, GrowingLayer) and cur is not None and new_t == T else None
            if got is not None and got[0].shape[0] >= B + n:
                kbuf, vbuf, start = got
            else:
                cap = max(new_t + GROW_MIN, int(new_t * GROW))
                rows_cap = max(B + n, self.batch_capacity)
                kbuf = pk.new_empty(rows_cap, pk.shape[1], cap, pk.shape[3])
                vbuf = pv.new_empty(rows_cap, pv.shape[1], cap, pv.shape[3])
                start = 0
                if B:
                    old = T if cur is not None else 0
                    for buf, x in ((kbuf, pk if cur is not None else None), (vbuf, pv if cur is not None else None)):
                        buf[:B, :, : new_t - old] = 0  # padding: masked out, but 0 x NaN is NaN
                        if x is not None:
                            buf[:B, :, new_t - old: new_t] = x
            for j, (kv, L) in enumerate(rows):
                b = B + j
                for buf, x in ((kbuf, kv[li][0] if L else None), (vbuf, kv[li][1] if L else None)):
                    buf[b, :, start: start + new_t - L] = 0
                    if x is not None:
                        buf[b, :, start + new_t - L: start + new_t] = x[0]
            if not layer.is_initialized:
                layer.lazy_initialization(pk, pv)
            _hold(layer, kbuf, vbuf, B + n, start, new_t)

    def keep_rows(self, keep: list[int]) -> None:
        """Keep only these rows (in this order)."""
        if not keep:
            self.reset()
            return
        if not self.masked:
            assert keep == [0], keep
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.mask = self.mask.index_select(0, idx)
        # In place when every kept row either stays or comes from a row past the new end
        # (never one that an earlier move overwrote): rows move inside the layer's buffer.
        n = len(keep)
        movable = all(src == i or src >= n for i, src in enumerate(keep)) or keep == sorted(keep)
        for layer in self.layers():
            if not (movable and _keep_in_place(layer, keep)):
                layer.keys = layer.keys.index_select(0, idx)
                layer.values = layer.values.index_select(0, idx)
        self.trim()

    def trim(self) -> None:
        """Drop slots no row uses at the left and right ends; compact when holes dominate."""
        T = self.mask.shape[1]
        if T == 0 or not self.masked:
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
            gi = index[:, None, :, None].expand(B, layer.keys.shape[1], new_t, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, gi)
            layer.values = layer.values.gather(2, index[:, None, :, None].expand(
                B, layer.values.shape[1], new_t, layer.values.shape[3]))


def _keep_in_place(layer, keep: list[int]) -> bool:
    """Keep rows `keep` of a growing layer by moving them inside its buffers (row i gets row
    keep[i]; the caller checked that no source is overwritten before it is read); False
    when the layer's keys are not views of its buffers."""
    got = layer.views() if isinstance(layer, GrowingLayer) else None
    if got is None or len(set(keep)) != len(keep) or max(keep) >= layer.keys.shape[0]:
        return False
    kbuf, vbuf, start = got
    T = layer.keys.shape[2]
    for i, src in enumerate(keep):
        if src != i:
            kbuf[i, :, start: start + T] = kbuf[src, :, start: start + T]
            vbuf[i, :, start: start + T] = vbuf[src, :, start: start + T]
    n = len(keep)
    layer.keys, layer.values = kbuf[:n, :, start: start + T], vbuf[:n, :, start: start + T]
    return True


def _hold(layer, kbuf: torch.Tensor, vbuf: torch.Tensor, rows: int, start: int, length: int) -> None:
    """Make a layer's keys/values the first `rows` rows, slots [start, start + length), of
    these buffers (a growing layer appends after them in place)."""
    layer.keys, layer.values = kbuf[:rows, :, start: start + length], vbuf[:rows, :, start: start + length]
    if isinstance(layer, GrowingLayer):
        layer._kbuf, layer._vbuf = kbuf, vbuf


def _hold_copy(layer, pair: tuple[torch.Tensor, torch.Tensor], room: int) -> None:
    """Give an empty layer a copy of keys/values [1, H, m, D], with room for `room` more
    positions (and the growing layer's spare capacity)."""
    k, v = pair
    m = k.shape[2]
    cap = max(m + room + GROW_MIN, int((m + room) * GROW))
    kbuf = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
    vbuf = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
    kbuf[:, :, :m] = k
    vbuf[:, :, :m] = v
    if not layer.is_initialized:
        layer.lazy_initialization(k, v)
    _hold(layer, kbuf, vbuf, k.shape[0], 0, m)


def left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
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
