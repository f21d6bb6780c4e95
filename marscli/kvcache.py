"""KV-cache helpers: one place that knows how transformers' caches are made and rolled back."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

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


def _start_in(buf: torch.Tensor | None, cur: torch.Tensor) -> int | None:
    """The slot where view `cur` [B, H, T, D] begins inside `buf` [B, H, cap, D], or None if
    `cur` is not such a view (another batch size, a copy, a different layout)."""
    if buf is None or cur.dim() != 4 or cur.shape[0] != buf.shape[0] or cur.shape[1] != buf.shape[1] \
            or cur.shape[3] != buf.shape[3] or cur.stride() != buf.stride() or cur.dtype != buf.dtype:
        return None
    if cur.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
        return None
    offset = cur.storage_offset() - buf.storage_offset()
    step = buf.stride(2)
    if offset < 0 or offset % step:
        return None
    start = offset // step
    return start if start + cur.shape[2] <= buf.shape[2] else None


def _append(cur: torch.Tensor | None, buf: torch.Tensor | None, new: torch.Tensor):
    """(cur followed by new, as a view of a buffer; that buffer)."""
    S = new.shape[2]
    T = 0 if cur is None or cur.numel() == 0 else cur.shape[2]
    start = _start_in(buf, cur) if T else None
    if start is not None and start + T + S <= buf.shape[2]:
        buf[:, :, start + T: start + T + S] = new
        return buf[:, :, start: start + T + S], buf
    cap = max(T + S + GROW_MIN, int((T + S) * GROW))
    fresh = new.new_empty(new.shape[0], new.shape[1], cap, new.shape[3])
    if T:
        fresh[:, :, :T] = cur
    fresh[:, :, T: T + S] = new
    return fresh[:, :, : T + S], fresh


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


def rollback(cache: DynamicCache, length: int) -> None:
    """Keep only the first `length` positions of every layer."""
    current = cache.get_seq_length()
    assert length <= current, f"cannot roll a cache of {current} positions forward to {length}"
    # transformers >= 5 takes a negative count to remove. crop(0) is not skipped: sliding-window
    # layers that record their past trim back to their window only when cropped.
    cache.crop(length - current)
