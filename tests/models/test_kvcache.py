"""The growing cache layer: same logits as transformers' own cache, through appends,
rollbacks and batch reshuffles, and appends really land in place."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from marscli.models.kvcache import GrowingLayer, new_cache, rollback
from tests.models.cache_walks import tiny_llama


def _model():
    return tiny_llama(256)


def test_new_cache_uses_growing_layers():
    cache = new_cache(_model())
    assert cache.layers and all(type(layer) is GrowingLayer for layer in cache.layers)


def test_speculative_pattern_matches_plain_forward():
    """Feed chunks, roll back a random part of each (as a rejected draft), and compare every
    chunk's logits with one plain forward over the committed sequence."""
    model = _model()
    gen = torch.Generator().manual_seed(1)
    cache = new_cache(model)
    seq: list[int] = []
    with torch.inference_mode():
        for step in range(40):
            chunk = torch.randint(0, 50, (1 + step % 5,), generator=gen).tolist()
            out = model(input_ids=torch.tensor([chunk]), past_key_values=cache, use_cache=True).logits
            ref = model(input_ids=torch.tensor([seq + chunk])).logits[:, len(seq):]
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            keep = int(torch.randint(0, len(chunk) + 1, (1,), generator=gen))
            seq += chunk[:keep]
            rollback(cache, len(seq))
            assert cache.get_seq_length() == len(seq)


def test_appends_after_a_rollback_write_in_place():
    model = _model()
    cache = new_cache(model)
    with torch.inference_mode():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache, use_cache=True)
        layer = cache.layers[0]
        buf = layer._kbuf
        rollback(cache, 3)
        model(input_ids=torch.tensor([[6, 7]]), past_key_values=cache, use_cache=True)
        assert layer._kbuf is buf, "a short append after a rollback must reuse the buffer"
        assert layer.keys.data_ptr() == buf.data_ptr() and layer.keys.shape[2] == 5


def test_replaced_keys_get_a_new_buffer_and_stay_right():
    """Code that swaps keys for a copy (index_select on batch rows, as batching does) must
    not be written over: the layer notices the copy and starts a new buffer."""
    model = _model()
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]])
    ours, plain = new_cache(model), DynamicCache(config=model.config)
    with torch.inference_mode():
        for c in (ours, plain):
            model(input_ids=ids, past_key_values=c, use_cache=True)
            for layer in c.layers:
                keep = torch.tensor([2, 0])
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
        nxt = torch.tensor([[13], [14]])
        a = model(input_ids=nxt, past_key_values=ours, use_cache=True).logits
        b = model(input_ids=nxt, past_key_values=plain, use_cache=True).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_step_inputs_are_not_kept_and_the_cache_keyword_is_read_once():
    """to_device (every step's ids, mask and positions) keeps no reference to what it moved:
    a memoised to_device (a61640f to here: a decorator meant for _cache_keyword) kept every
    step's inputs, and on CUDA their device copies, alive for the life of the process. The
    forward's cache keyword is what is read once per forward function."""
    import gc
    import weakref

    from marscli.models import kvcache

    t = torch.zeros(3, dtype=torch.long)
    ref = weakref.ref(t)
    moved = kvcache.to_device(t, torch.device("cpu"))
    assert torch.equal(moved, torch.zeros(3, dtype=torch.long))
    del t, moved
    gc.collect()
    assert ref() is None
    model = tiny_llama(16)
    kvcache._cache_keyword.cache_clear()
    for _ in range(3):
        kvcache.cache_kw(model, None)
    info = kvcache._cache_keyword.cache_info()
    assert info.misses == 1 and info.hits == 2, info
