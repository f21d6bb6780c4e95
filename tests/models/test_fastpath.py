"""The CPU fast path changes summation order only."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from marscli.models.fastpath import (
    BODY_ROWS,
    HEAD_ROWS,
    SMALL_LINEAR,
    SMALL_ROWS_ENV,
    SMALL_TRANSPOSED,
    install_cpu_fastpath,
)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 24)
        self.head = nn.Linear(24, 50, bias=False)
        self.half = nn.Linear(4, 4).to(torch.bfloat16)

    def get_output_embeddings(self):
        return self.head


@pytest.fixture(params=[SMALL_TRANSPOSED, SMALL_LINEAR])
def small(request, monkeypatch):
    """Both ways of running small products, whatever this CPU's vendor picks."""
    monkeypatch.setenv(SMALL_ROWS_ENV, request.param)
    return request.param


def test_fastpath_matches_linear_for_every_row_count(small):
    torch.manual_seed(0)
    m = Toy()
    ref = {name: (mod.weight.clone(), None if mod.bias is None else mod.bias.clone())
           for name, mod in [("body", m.body), ("head", m.head)]}
    assert install_cpu_fastpath(m) == 2  # the bfloat16 layer is left alone
    assert install_cpu_fastpath(m) == 2  # idempotent: patching twice changes nothing
    for rows in range(1, 40):
        # inference (the packed weights from 3 rows on) and autograd (dense products only)
        for ctx in (torch.inference_mode, torch.enable_grad):
            x = torch.randn(1, rows, 16)
            with ctx():
                h = m.body(x)
                y = m.head(h)
                want_h = nn.functional.linear(x, *ref["body"])
                want_y = nn.functional.linear(h, ref["head"][0])
            assert h.shape == (1, rows, 24)
            torch.testing.assert_close(h, want_h, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
            # Contiguous like F.linear's: a transposed q/k/v projection sends SDPA to its math
            # kernel, which copies the KV cache per layer.
            assert h.is_contiguous() and y.is_contiguous(), rows
    assert BODY_ROWS[0] == 1 and HEAD_ROWS[0] == 1  # 1-row decode is patched too


def test_one_row_runs_as_a_two_column_matrix_product(monkeypatch):
    """Transposed small products: a 1-row input never reaches torch's matrix-vector path: its
    one product has a second (copied) column, which is what makes a 1-token forward as cheap
    as a 2-token one on CPUs whose matrix-vector kernel streams the weights slowly (module
    docstring)."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setenv(SMALL_ROWS_ENV, SMALL_TRANSPOSED)
    torch.manual_seed(0)
    m = Toy()
    install_cpu_fastpath(m)
    x = torch.randn(1, 1, 16)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        m.body(x)
    shapes = [e.input_shapes for e in p.key_averages(group_by_input_shape=True)
              if e.key in ("aten::mm", "aten::addmm", "aten::mv", "aten::addmv")]
    assert shapes == [[[24, 16], [16, 2]]], shapes


def _products(m, rows):
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as p:
        m.body(torch.randn(1, rows, 16))
    return {e.key for e in p.key_averages()} & {"aten::mm", "aten::addmm", "aten::mv", "aten::addmv",
                                                "mkldnn::_linear_pointwise"}


def test_small_products_follow_the_cpu_vendor(monkeypatch):
    """Intel CPUs keep torch's own product for 1-2 rows (MKL's kernels there stream the
    weights at full speed); other CPUs transpose it; the environment overrides the rule, and
    the fast path's signature (a key of the measured costs) names the choice."""
    from marscli.models import fastpath

    monkeypatch.delenv(SMALL_ROWS_ENV, raising=False)
    monkeypatch.setattr(fastpath, "cpu_vendor", lambda: "GenuineIntel")
    assert fastpath.small_rows() == SMALL_LINEAR and fastpath.signature()["small_rows"] == SMALL_LINEAR
    assert fastpath.signature()["one_row"] is None
    m = Toy()
    install_cpu_fastpath(m)
    with torch.inference_mode():
        for rows in (1, 2):
            x = torch.randn(1, rows, 16)
            assert torch.equal(m.body(x), nn.functional.linear(x, m.body.weight, m.body.bias)), rows
    for vendor in ("AuthenticAMD", None):
        monkeypatch.setattr(fastpath, "cpu_vendor", lambda v=vendor: v)
        assert fastpath.small_rows() == SMALL_TRANSPOSED and fastpath.signature()["one_row"] == "padded to 2"
    monkeypatch.setenv(SMALL_ROWS_ENV, SMALL_LINEAR)
    assert fastpath.small_rows() == SMALL_LINEAR
    monkeypatch.setenv(SMALL_ROWS_ENV, "fast")
    with pytest.raises(ValueError, match="MARSCLI_CPU_SMALL_ROWS"):
        fastpath.small_rows()


def test_three_rows_and_more_run_on_the_packed_weights(small):
    """From PACKED_FROM rows on (verification, batched steps, prefill) the product runs on
    oneDNN's reordered copy of the weights; 1-2 rows keep the dense product (faster there).
    x86 builds of torch have oneDNN, so there the packed path must be on."""
    import platform

    from marscli.models.fastpath import PACKED_FROM, packed_available

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("oneDNN's packed linear is checked on x86 builds of torch")
    assert packed_available()
    torch.manual_seed(0)
    m = Toy()
    install_cpu_fastpath(m)
    assert PACKED_FROM == 3
    for rows in (1, 2):
        assert _products(m, rows) == ({"aten::mm"} if small == SMALL_TRANSPOSED else {"aten::addmm"}), rows
    for rows in (3, 9, 40):
        assert _products(m, rows) == {"mkldnn::_linear_pointwise"}, rows


def test_packed_weights_can_be_switched_off(monkeypatch):
    """MARSCLI_CPU_PACKED=0 (or packed=False) keeps one copy of the weights: dense products
    only, and the fast path's signature (a key of the measured costs) says so."""
    from marscli.models.fastpath import signature

    torch.manual_seed(0)
    m = Toy()
    monkeypatch.setenv(SMALL_ROWS_ENV, SMALL_TRANSPOSED)
    install_cpu_fastpath(m, packed=False)
    assert _products(m, 9) == {"aten::mm"}
    monkeypatch.setenv("MARSCLI_CPU_PACKED", "0")
    assert signature()["packed_from"] is None
    m2 = Toy()
    install_cpu_fastpath(m2)
    assert _products(m2, 9) == {"aten::mm"}
    assert not any(hasattr(mod, "_marscli_packed") for mod in m2.modules())


def tiny_gqa_llama():
    """A random 2-layer Llama with grouped-query attention (6 query heads, 2 KV heads), SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=128)
    m = LlamaForCausalLM(cfg).eval()
    m.set_attn_implementation("sdpa")
    return m


def test_gqa_attention_matches_sdpa_with_holes_and_cache():
    """The GQA-aware attention gives transformers' SDPA logits, with a 2D padding mask and a
    cache, as the batched engine uses it (and it is what a CPU engine switches to)."""
    from transformers import DynamicCache

    from marscli.models.fastpath import GQA_SDPA, install_gqa_attention

    torch.manual_seed(0)
    m = tiny_gqa_llama()
    ids = torch.randint(0, 64, (3, 20))
    mask = torch.ones(3, 25, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[1, 7:9] = 0  # holes
    new = torch.randint(0, 64, (3, 5))
    pos = torch.arange(20, 25).expand(3, 5)

    def run():
        c = DynamicCache(config=m.config)
        m(input_ids=ids, attention_mask=mask[:, :20], past_key_values=c, use_cache=True)
        return m(input_ids=new, attention_mask=mask, position_ids=pos, past_key_values=c, use_cache=True).logits

    with torch.inference_mode():
        ref = run()
        assert install_gqa_attention(m)
        assert m.config._attn_implementation == GQA_SDPA
        got = run()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not install_gqa_attention(m)  # already switched: nothing to do


def test_folded_gqa_attention_matches_sdpa_and_reads_no_copied_heads(monkeypatch):
    """The accelerators' attention (query groups folded into the query axis) gives
    transformers' SDPA logits with holes, a cache and a slot cache's step, and never calls
    repeat_kv (the copy of every shared key/value head per step it exists to avoid)."""
    from transformers import DynamicCache
    from transformers.integrations import sdpa_attention

    from marscli.models.fastpath import GQA_FOLD, folded_gqa, install_folded_gqa_attention
    from marscli.models.slots import SlotCache

    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    mask = torch.rand(2, 1, 5, 11) > 0.3
    mask[..., 0] = True
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(folded_gqa(q, k, v, mask, None), ref, rtol=1e-5, atol=1e-6)
    m = tiny_gqa_llama()
    ids = torch.randint(0, 64, (3, 20))
    hole = torch.ones(3, 25, dtype=torch.long)
    hole[0, :4] = 0
    hole[1, 7:9] = 0
    new = torch.randint(0, 64, (3, 5))
    pos = torch.arange(20, 25).expand(3, 5)

    def run():
        c = DynamicCache(config=m.config)
        m(input_ids=ids, attention_mask=hole[:, :20], past_key_values=c, use_cache=True)
        holes = m(input_ids=new, attention_mask=hole, position_ids=pos, past_key_values=c, use_cache=True).logits
        kv = SlotCache(m, "cpu", slots=3)
        one = DynamicCache(config=m.config)
        m(input_ids=ids[:1], past_key_values=one, use_cache=True)
        kv.add_rows([([(layer.keys, layer.values) for layer in one.layers], 20)] * 3)
        slots = kv.forward(new, None, pos).logits
        return holes, slots

    with torch.inference_mode():
        ref = run()
        assert install_folded_gqa_attention(m) and m.config._attn_implementation == GQA_FOLD
        calls = []
        real = sdpa_attention.repeat_kv
        monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda *a: calls.append(1) or real(*a))
        got = run()
    assert calls == []
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_gqa_attention_leaves_plain_multi_head_models_alone():
    from transformers import LlamaConfig, LlamaForCausalLM

    from marscli.models.fastpath import install_gqa_attention

    cfg = LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4)
    m = LlamaForCausalLM(cfg)
    m.set_attn_implementation("sdpa")
    assert not install_gqa_attention(m)
    assert m.config._attn_implementation == "sdpa"


def test_patched_projections_keep_attention_on_the_fused_kernel():
    """A 2-token forward of a GQA model with the fast path calls SDPA with a query whose last
    dimension is contiguous (the fused CPU kernel's condition), so the attention never
    expands the cached keys and values (no copy of the cache's size)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import DynamicCache

    torch.manual_seed(0)
    m = tiny_gqa_llama()
    install_cpu_fastpath(m)
    with torch.inference_mode():
        c = DynamicCache(config=m.config)
        m(input_ids=torch.randint(0, 64, (1, 40)), past_key_values=c, use_cache=True)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            m(input_ids=torch.randint(0, 64, (1, 2)), past_key_values=c, use_cache=True)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::bmm" not in ops  # the math kernel's batched products
