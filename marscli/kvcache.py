"""KV-cache helpers: one place that knows how transformers' caches are made and rolled back."""

from __future__ import annotations

from transformers import DynamicCache


def new_cache(model) -> DynamicCache:
    """An empty cache laid out for `model` (sliding-window layers record their past so that
    they too can be rolled back)."""
    cache = DynamicCache(config=model.config)
    for layer in getattr(cache, "layers", []):
        if hasattr(layer, "activate_past_recording"):
            layer.activate_past_recording()
    return cache


def rollback(cache: DynamicCache, length: int) -> None:
    """Keep only the first `length` positions of every layer."""
    current = cache.get_seq_length()
    assert length <= current, f"cannot roll a cache of {current} positions forward to {length}"
    # transformers >= 5 takes a negative count to remove. crop(0) is not skipped: sliding-window
    # layers that record their past trim back to their window only when cropped.
    cache.crop(length - current)
