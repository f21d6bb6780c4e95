"""Decoder layers of int8 CPU models in two TorchScript calls each, the same bits.

An int8 model's forward on the CPU is bound by the cost per torch op, not by bandwidth: a
decoder layer of Qwen2.5-Coder-0.5B runs ~130 small ops (norms, rotary embedding, the row
quantization of 4 products, the float64 attention's casts) around 4 int8 products, and each op
costs Python's call into torch besides the kernel. A 1-token forward at 300 cached tokens took
69 ms, of which fbgemm's products were ~30.

Here a patched layer makes two calls into TorchScript's interpreter, which runs the same ATen
ops in the same order without Python: `_pre` (input norm, fused q/k/v product, rotary
embedding) and, after the KV cache's Python update, `_post` (float64 attention, o_proj,
residual, post-attention norm, fused gate/up product, SiLU, down product, residual). Measured
on the VNNI Xeon (`python lab/scripts/profile_forward.py`, lab/benchmarks-history.md): the 0.5B's
1-token forward 69 -> 49 ms, the 1.5B's 134 -> 110 ms, logits equal bit for bit.

Only layers whose code was read and mirrored op for op are patched: transformers' Llama and
Qwen2 decoder layers (SmolLM2, Qwen2.5), with marscli's fused int8 siblings and float64
attention. Anything else keeps transformers' modules, as does a call this does not mirror
(one `fastpath.cpu_sdpa_forward` hands to transformers, a non-float32 input, training).
tests/models/test_int8_decoder.py checks the logits against the unpatched layers bit for bit.
"""

from __future__ import annotations

import functools
from typing import List, Optional

import torch
from torch import nn
from torch.nn import functional as F

from marscli.models.fastpath import leaves_to_transformers, sdpa
from marscli.models.quant import (
    F64_SDPA,
    LEVELS,
    TINY,
    X_SCALE,
    X_ZERO,
    Int8Linear,
    Int8Slice,
    int8_product,
    script,
)

#: What a patched layer computes, for keys of measurements that depend on it.
SIGNATURE = "torchscript-layer-v1"
#: Decoder layers whose forward (with their attention, MLP and RMSNorm) this module mirrors.
LAYERS = {"LlamaDecoderLayer": ("LlamaAttention", "LlamaMLP", "LlamaRMSNorm"),
          "Qwen2DecoderLayer": ("Qwen2Attention", "Qwen2MLP", "Qwen2RMSNorm")}
_PATCHED = "_marscli_int8_decoder"
try:  # fbgemm's packed weight, as TorchScript names it (absent where torch has no fbgemm)
    Packed = torch.classes.quantized.LinearPackedParamsBase
except (AttributeError, RuntimeError):
    Packed = object


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm / Qwen2RMSNorm, op for op."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _pre(x: torch.Tensor, norm: torch.Tensor, eps: float, qkv: Packed, qkv_bias: Optional[torch.Tensor],
         heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
         levels: torch.Tensor, tiny: float, scale: float, zero: int) -> List[torch.Tensor]:
    """Input norm, the fused q/k/v product, and the rotary embedding: [q, k, v] as
    (batch, heads, tokens, head_dim), as transformers' attention builds them."""
    h = _rms_norm(x, norm, eps)
    y = int8_product(h, qkv, qkv_bias, levels, tiny, scale, zero, (heads + 2 * kv_heads) * head_dim)
    shape = list(x.shape[:-1])
    shape.extend([-1, head_dim])
    q = y[..., : heads * head_dim].view(shape).transpose(1, 2)
    k = y[..., heads * head_dim: (heads + kv_heads) * head_dim].view(shape).transpose(1, 2)
    v = y[..., (heads + kv_heads) * head_dim:].view(shape).transpose(1, 2)
    cos = cos.unsqueeze(1)
    sin = sin.unsqueeze(1)
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    return [q, k, v]


def _post(x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
          scaling: float, gqa: bool, o: Packed, o_bias: Optional[torch.Tensor],
          norm: torch.Tensor, eps: float, gate_up: Packed, gate_up_bias: Optional[torch.Tensor], inter: int,
          down: Packed, down_bias: Optional[torch.Tensor],
          levels: torch.Tensor, tiny: float, scale: float, zero: int) -> torch.Tensor:
    """The rest of the layer: float64 attention (the `sdpa` that `quant._f64_sdpa_forward`
    runs), o_proj, residual, post-attention norm, MLP, residual."""
    width = x.shape[-1]
    a = sdpa(q, k, v, mask, 0.0, scaling, True, gqa, torch.float64)
    shape = list(x.shape[:-1])
    shape.append(-1)
    a = a.reshape(shape).contiguous()
    x = x + int8_product(a, o, o_bias, levels, tiny, scale, zero, width)
    h = _rms_norm(x, norm, eps)
    y = int8_product(h, gate_up, gate_up_bias, levels, tiny, scale, zero, 2 * inter)
    h = F.silu(y[..., :inter]) * y[..., inter:]
    return x + int8_product(h, down, down_bias, levels, tiny, scale, zero, width)


@functools.cache
def _scripted():
    return script(_pre), script(_post)


def _siblings(slices: list) -> Int8Linear | None:
    """The fused layer that `slices` split, in order and without gaps; None otherwise."""
    if not all(isinstance(s, Int8Slice) for s in slices):
        return None
    fused = slices[0].fused[0]
    start = 0
    for s in slices:
        if s.fused[0] is not fused or s.start != start:
            return None
        start = s.stop
    return fused if start == fused.out_features else None


def _mirrorable(layer: nn.Module) -> bool:
    names = LAYERS.get(type(layer).__name__)
    if names is None:
        return False
    att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    if (type(att).__name__, type(mlp).__name__) != names[:2] or any(type(n).__name__ != names[2] for n in norms):
        return False
    if getattr(getattr(att, "config", None), "_attn_implementation", None) != F64_SDPA:
        return False
    # torch's SiLU, or transformers' SiLUActivation (F.silu, unless a hub kernel was swapped in)
    act = getattr(mlp, "act_fn", None)
    if not getattr(att, "is_causal", False) or not (type(act) is nn.SiLU or (
            type(act).__name__ == "SiLUActivation" and type(act).forward.__qualname__ == "SiLUActivation.forward")):
        return False
    if _siblings([att.q_proj, att.k_proj, att.v_proj]) is None or _siblings([mlp.gate_proj, mlp.up_proj]) is None:
        return False
    if not (isinstance(att.o_proj, Int8Linear) and isinstance(mlp.down_proj, Int8Linear)):
        return False
    hd = att.head_dim
    return att.q_proj.out_features % hd == 0 and att.k_proj.out_features == att.v_proj.out_features
    # (mlp.gate_proj and up_proj have one width: the SiLU product multiplies them elementwise)


def _patch(layer: nn.Module) -> None:
    att, mlp = layer.self_attn, layer.mlp
    qkv, gate_up = _siblings([att.q_proj, att.k_proj, att.v_proj]), _siblings([mlp.gate_proj, mlp.up_proj])
    o, down = att.o_proj, mlp.down_proj
    ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
    hd = att.head_dim
    heads, kv_heads = att.q_proj.out_features // hd, att.k_proj.out_features // hd
    inter, gqa, idx, scaling = mlp.gate_proj.out_features, heads != kv_heads, att.layer_idx, att.scaling
    original = layer.forward
    pre, post = _scripted()
    consts = (LEVELS, TINY, X_SCALE, X_ZERO)

    def forward(hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                position_embeddings=None, **kwargs):
        if cache is None and "past_key_values" in kwargs:
            cache = kwargs.pop("past_key_values")
        if (layer.training or position_embeddings is None or hidden_states.dtype != torch.float32
                or leaves_to_transformers(hidden_states.device, kwargs)):
            return original(hidden_states, attention_mask=attention_mask, position_ids=position_ids, cache=cache,
                            use_cache=use_cache, position_embeddings=position_embeddings, **kwargs)
        cos, sin = position_embeddings
        q, k, v = pre(hidden_states, ln1.weight, ln1.variance_epsilon, qkv._packed, qkv.bias, heads, kv_heads, hd,
                      cos, sin, *consts)
        if cache is not None:
            k, v = cache.update(k, v, idx, kwargs=kwargs)
        return post(hidden_states, q, k, v, attention_mask, scaling, gqa, o._packed, o.bias,
                    ln2.weight, ln2.variance_epsilon, gate_up._packed, gate_up.bias, inter, down._packed, down.bias,
                    *consts)

    layer.forward = forward
    setattr(layer, _PATCHED, True)


def install_int8_decoder(model: nn.Module) -> int:
    """Patch every decoder layer of `model` that this module mirrors; how many were patched.
    For int8 CPU models after `quantize_int8` and `install_f64_attention`."""
    n = 0
    for mod in model.modules():
        if not getattr(mod, _PATCHED, False) and _mirrorable(mod):
            _patch(mod)
            n += 1
    return n


def uninstall_int8_decoder(model: nn.Module) -> int:
    """Give patched layers back their transformers forward (for comparisons); how many."""
    n = 0
    for mod in model.modules():
        if getattr(mod, _PATCHED, False):
            del mod.forward  # the instance's patch; the class's forward shows through again
            delattr(mod, _PATCHED)
            n += 1
    return n
