"""The KV cache pieces below the slot cache (marscli.models.slots): growing layers, rollback,
host-to-device step inputs, and the contiguous one-row cache of a model that slots cannot
hold (ContiguousCache)."""

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
    """

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self._kbuf = _append(self.keys, getattr(self, "_kbuf", None), key_states)
        self.values, self._vbuf = _append(self.values, getattr(self, "_vbuf", None), value_states)
        return self.keys, self.values

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


def _append(cur: torch.Tensor | None, buf: torch.Tensor | None, new: torch.Tensor):
    """(cur followed by new, as a view of a buffer; that buffer)."""
    B, S = new.shape[0], new.shape[2]
    T = 0 if cur is None or cur.numel() == 0 else cur.shape[2]
    start = _start_in(buf, cur) if T else None
    if start is not None and start + T + S <= buf.shape[2]:
        buf[:B, :, start + T: start + T + S] = new
        return buf[:B, :, start: start + T + S], buf
    cap = max(T + S + GROW_MIN, int((T + S) * GROW))
    fresh = new.new_empty(B, new.shape[1], cap, new.shape[3])
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


# --------------------------------------------------------------------------------------------
# The engine's cache: one row per record


class ContiguousCache:
    """The KV cache of one record whose model a slot cache cannot hold (sliding-window
    layers, which record their past only to be cropped, or an attention that takes no custom
    mask: marscli.models.slots.supports): at most one row and never a hole. The drafts a step
    rejects are at the end, so they are rolled back (cropped), and a forward is the plain
    single-sequence call (no mask, no position ids). Every other model's rows, at every
    batch size, live in a SlotCache, whose interface this one shares (forward / commit /
    truncate_row / keep_rows / trim / nbytes)."""

    def __init__(self, model, device):
        self.model = model
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.cache = new_cache(self.model)
        self.length = 0
        self._rows = 0

    def clear_rows(self) -> None:
        """No row (as SlotCache.clear_rows; a contiguous cache keeps nothing worth keeping)."""
        self.reset()

    @property
    def rows(self) -> int:
        return self._rows

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers() for t in (layer.keys, layer.values))

    def layers(self):
        return [layer for layer in self.cache.layers if getattr(layer, "is_initialized", False)
                and layer.keys is not None and layer.keys.numel() > 0]

    # ------------------------------------------------------------------ forward and commit

    def forward(self, ids: torch.Tensor, new_mask: torch.Tensor | None, pos: torch.Tensor, **kw):
        """Run the model on the one row's ids [1, S] over the cache (new_mask and pos are the
        slot cache's and not read: the row is never padded and its positions follow the
        cache); the new positions stay in the cache until commit()."""
        assert ids.shape[0] == 1 and self._rows == 1, "a contiguous cache runs one row"
        return self.model(input_ids=ids, **cache_kw(self.model, self.cache), use_cache=True, **kw)

    def commit(self, new_mask: torch.Tensor, kept: list[int] | None = None) -> None:
        """The row keeps the first kept[0] (or new_mask.sum()) of the last forward's new
        positions: the rest is rolled back."""
        n = int(kept[0]) if kept is not None else int(new_mask.sum())
        self.length += n
        rollback(self.cache, self.length)

    def truncate_row(self, b: int, keep: int) -> None:
        """The row keeps its first `keep` positions (a rollback)."""
        assert b == 0, "a contiguous cache holds one row"
        self.length = min(self.length, keep)
        rollback(self.cache, self.length)

    def trim(self) -> None:
        """Nothing to trim: the row has no holes."""

    # ------------------------------------------------------------------ the row

    def add_prefilled(self, ids: list[int], run=None, *, past=None) -> torch.Tensor | None:
        """Hold a record whose cached tokens are `ids` (a prompt, or a prompt but its pending
        last token), prefilled in one pass. past: (m, keys/values per layer [1, H, m, D])
        already computed for the m tokens before ids (a cached prefix; copied). run(forward)
        wraps the model call (the engine captures target features there). Returns the
        logits [V] at the last of ids (None when ids is empty)."""
        assert self._rows == 0, "a contiguous cache holds one row"
        run = run or (lambda f: f())
        m = 0
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
        self.length = m + len(ids)
        self._rows = 1
        return logits

    def row_kv(self, length: int) -> list:
        """The row's first `length` positions per layer ([1, H, length, D] views; None for a
        layer that holds nothing)."""
        assert self._rows == 1
        return [(layer.keys[:, :, :length], layer.values[:, :, :length])
                if layer.is_initialized and layer.keys is not None and layer.keys.numel() else None
                for layer in self.cache.layers]

    def keep_rows(self, keep: list[int]) -> None:
        """Keep the row ([0]) or none ([])."""
        if not keep:
            self.reset()
            return
        assert keep == [0], keep


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
    # the layer's keys/values are the first m slots of the buffers; a growing layer appends
    # after them in place
    layer.keys, layer.values = kbuf[:, :, :m], vbuf[:, :, :m]
    if isinstance(layer, GrowingLayer):
        layer._kbuf, layer._vbuf = kbuf, vbuf
