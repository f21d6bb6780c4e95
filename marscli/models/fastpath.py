"""CPU fast path for the few-row matrix products of speculative verification.

On x86 CPUs, torch's `F.linear` for an input of 2-9 rows streams the weight matrix from
memory more than once, so verifying a few drafts cost far more than a 1-token forward.
Written as `W @ x.T` the same product reads the weights once. The result is made contiguous
(a copy of rows x out floats): a transposed q/k/v projection would otherwise send every
layer's attention to SDPA's math kernel, which copies the whole KV cache per layer to
repeat the shared heads (6-18 ms a forward at 256 cached tokens, and what made a 2-token
verification cost 1.2x a 1-token forward). Measured on this project's 2-core AVX2 CPU with
the embedded SmolLM2-135M (float32, 256-token context, ms per forward, fastest of 16
interleaved rounds of `python lab/scripts/fastpath_costs.py --rounds 16`):

| new tokens                              | 1  | 2  | 3   | 4   | 5   | 6   | 9   |
| rows 2-3 patched, transposed (before)   | 74 | 78 | 101 | 113 | 103 | 108 | 118 |
| rows 2-9 patched, contiguous (now)      | 76 | 58 | 67  | 60  | 72  | 98  | 105 |

Qwen2.5-Coder-1.5B (the pair's target), 8 rounds: 419/612/797/1148/1147/1353/1281 ms before,
411/425/544/469/556/618/775 ms now.

One row is padded to two (2026-11-25). torch's one-row product is a matrix-vector kernel
that, on the AMD EPYC host this project ran on that day (MKL 2024.2, 2 threads), streamed
the weights at about 60% of the bandwidth a two-column product gets: a 1-token forward of
Qwen2.5-Coder-1.5B cost 387 ms against 245 ms with its rows padded to two (the 0.5B: 158
against 86 ms; min of 8 interleaved rounds at 256 cached tokens, logits within 2e-5, same
argmax), and a 2-token forward was cheaper than a 1-token one (252 ms). That made plain
decoding, and every draft-model token, pay for a slow kernel, and speculative decoding look
faster than it is (a step of one draft and a 2-token verification cost about one plain
step). The second column is a copy of the first and is dropped: twice the arithmetic on
data that is read once. On the host of earlier sessions (CPU model not recorded) a 2-token
forward cost 1.03x a 1-token one, so padding there should cost a few percent at most (not
measured there).

Three rows and more run on packed weights (2026-11-25, later still). Even as `W @ x.T`, MKL's
product over 3-9 columns ran at a fraction of the 2-column product's bandwidth on that host
(a forward of Qwen2.5-Coder-1.5B over 3/5/9 new tokens: 433/554/739 ms, against 243 ms for
one). oneDNN's matrix product on a copy of the weights reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`, which torch's compiler uses
for frozen bf16 linear layers; for float32 it picks MKL's packed GEMM, which was no faster
than the dense product here: 93 against 42 ms for 3 rows of twelve 8960 x 1536 matrices)
reads them at full speed for any row count: 266/226/267 ms (`python
lab/scripts/fastpath_costs.py --target qwen2.5-coder-1.5b-instruct --rounds 6`, 256 cached
tokens, min). Verifying 8 drafts now costs about one plain step. For 1-2 rows the dense
product stays (packed is as fast or up to 33% slower there, 10-33% slower with rows padded to
3), so plain decoding and the draft model's steps are unchanged. The price is memory: the
linear weights are held twice (the pair: 16.8 GB RSS after loading; its float32 weights are
8.2 GB), which MARSCLI_CPU_PACKED=0 avoids; autograd (the EAGLE-3 trainer) keeps the dense
products.

On Intel CPUs small products stay torch's own (2026-11-29). MKL chooses its kernels by the
CPU's vendor, and everything above was measured on an AMD EPYC. On a 2-core Intel Xeon
(Sapphire Rapids, AVX-512, same torch), the embedded model's decoder layers (30 x seven
matrices, 425 MB) took 21.4 ms for one row through `F.linear`, against 49.3 ms padded to two
columns; for 2 rows, 23.0 ms against 46.6 ms as `W @ x.T`; for 3, 25.6 ms (packed: 28.2). The
lm_head took 5.2 ms for one row against 12.8 ms padded (fastest of 4 rounds, weights out of
cache). So on a `GenuineIntel` CPU the products of 1-2 rows (and all of them without packed
weights) are `F.linear`'s, and from 3 rows on the packed copy's, as everywhere
(`small_rows()`; $MARSCLI_CPU_SMALL_ROWS=linear|transposed overrides the rule). The rule is
the vendor, not a timing: the kernels' rounding reaches the text, which must not depend on a
measurement.

The patch applies to float32 nn.Linear modules on the CPU only: the lm_head for 1-32 rows
(its 49152 x 576 matrix dominates), other layers for 1-9 rows (a batched step counts all its
rows: batch 4 with one new token each is 4 rows), and from 3 rows on, at any count, to the
packed copy. The patch changes summation order, not the math: results agree with F.linear to
float32 rounding. Plain decoding therefore no longer runs transformers' own kernel bit for
bit; `bench` runs transformers' generate() on the same patched model object, so its baseline
and correctness checks see the same kernels.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

HEAD_ROWS = (1, 32)
BODY_ROWS = (1, 9)
#: One row is computed as two equal columns (see the module docstring), where the small
#: products are transposed (SMALL_TRANSPOSED).
ONE_ROW = "padded to 2"
#: How products of fewer than PACKED_FROM rows run (and all of them without packed weights):
#: SMALL_TRANSPOSED, `W @ x.T` with one row padded to two, for MKL's slow small-row kernels on
#: CPUs that are not Intel's; SMALL_LINEAR, torch's own `F.linear`, whose MKL kernels stream the
#: weights at full speed on Intel CPUs (module docstring). ``small_rows()`` picks one.
SMALL_TRANSPOSED = "transposed"
SMALL_LINEAR = "linear"
SMALL_ROWS_ENV = "MARSCLI_CPU_SMALL_ROWS"
#: Rows from PACKED_FROM on (any count: verification, batched steps, prefill) go to oneDNN's
#: matrix product on a copy of the weights reordered once into its blocked layout.
PACKED_FROM = 3
_PATCHED = "_marscli_fastpath"
_PACKED = "_marscli_packed"


def packed_available() -> bool:
    """Whether this torch build has oneDNN's reordered-weight linear (x86 builds do)."""
    mkldnn = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight")
            and hasattr(mkldnn, "_linear_pointwise"))


def packed_enabled() -> bool:
    """Packed weights are used where available unless the environment sets MARSCLI_CPU_PACKED=0."""
    return os.environ.get("MARSCLI_CPU_PACKED", "1") != "0" and packed_available()


def cpu_vendor() -> str | None:
    """The CPU's vendor string (/proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD...), or
    None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return None


def small_rows() -> str:
    """How products of 1 to PACKED_FROM - 1 rows run on this machine: $MARSCLI_CPU_SMALL_ROWS
    (``linear`` or ``transposed``) where set, else ``linear`` on Intel CPUs (MKL dispatches its
    fast small-row kernels by vendor) and ``transposed`` elsewhere. A rule on what the CPU
    is, never on a timing: the kernels' rounding reaches the text (the reproducibility
    contract), so a run never picks them by a measurement."""
    chosen = os.environ.get(SMALL_ROWS_ENV, "").strip().lower()
    if chosen in (SMALL_LINEAR, SMALL_TRANSPOSED):
        return chosen
    if chosen:
        raise ValueError(f"${SMALL_ROWS_ENV}={chosen!r}: expected {SMALL_LINEAR} or {SMALL_TRANSPOSED}")
    return SMALL_LINEAR if cpu_vendor() == "GenuineIntel" else SMALL_TRANSPOSED


def signature() -> dict:
    """What the patch does, for keys of measurements that depend on it (marscli.engine.costs)."""
    small = small_rows()
    return {"head_rows": list(HEAD_ROWS), "body_rows": list(BODY_ROWS), "contiguous": True,
            "one_row": ONE_ROW if small == SMALL_TRANSPOSED else None, "small_rows": small,
            "packed_from": PACKED_FROM if packed_enabled() else None}


def _patch(linear: nn.Linear, lo: int, hi: int, packed: bool, small: str) -> None:
    if getattr(linear, _PATCHED, False):
        return
    plain = linear.forward
    if small == SMALL_LINEAR:  # torch's own product below PACKED_FROM rows
        lo, hi = 1, 0
    if packed:
        # A second copy of the weights, in oneDNN's layout; the dense one stays for 1-2 rows
        # (faster there) and for anything else that reads `linear.weight`.
        setattr(linear, _PACKED, torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None))

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        w = linear.weight
        pw = getattr(linear, _PACKED, None)
        # (inductor cannot lower the packed product: a compiled step, --compile on, takes the others)
        if pw is not None and rows >= PACKED_FROM and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            b = None if linear.bias is None else linear.bias.detach()
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), pw, b, "none", [], "")
            return y.reshape(*x.shape[:-1], w.shape[0])
        if lo <= rows <= hi:
            x2 = x.reshape(rows, x.shape[-1])
            # Contiguous, so that the attention that reads a projection takes SDPA's fused
            # kernel; one row as two columns, so that it gets the matrix-matrix kernel (see
            # the module docstring).
            if rows == 1:
                y = (w @ torch.cat((x2, x2)).T)[:, :1].T.contiguous()
            else:
                y = (w @ x2.T).T.contiguous()
            if linear.bias is not None:
                y = y + linear.bias
            return y.reshape(*x.shape[:-1], w.shape[0])
        return plain(x)

    linear.forward = forward
    setattr(linear, _PATCHED, True)


#: Our attention implementation's name in transformers' registries.
GQA_SDPA = "marscli_gqa_sdpa"


def leaves_to_transformers(device: torch.device, kwargs: dict) -> bool:
    """Whether an attention call is one `cpu_sdpa_forward` hands to transformers' own SDPA:
    not on the CPU, a position bias or softcap, a paged cache, attention weights asked for."""
    return (device.type != "cpu" or kwargs.get("position_bias") is not None
            or kwargs.get("softcap") is not None or kwargs.get("cache") is not None
            or bool(kwargs.get("output_attentions", False)))


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
         dropout: float, scaling: Optional[float], causal: bool, gqa: bool,
         compute_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """torch's SDPA over (batch, heads, tokens, head_dim), shared key/value heads read in place
    (`gqa`), optionally in `compute_dtype`; returned as (batch, tokens, heads, head_dim) in the
    query's dtype. Causal only for several queries and no mask (`causal`: the module's flag).
    TorchScript-compatible: the int8 decoder layers (marscli.models.int8_decoder) run it scripted."""
    is_causal = causal and query.shape[2] > 1 and mask is None
    q, k, v = query, key, value
    if compute_dtype is not None and compute_dtype != query.dtype:
        q, k, v = q.to(compute_dtype), k.to(compute_dtype), v.to(compute_dtype)
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.to(compute_dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scaling,
                                         is_causal=is_causal, enable_gqa=gqa)
    return out.to(query.dtype).transpose(1, 2).contiguous()


def cpu_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                     scaling: float | None = None, is_causal: bool | None = None, *,
                     compute_dtype: torch.dtype | None = None, **kwargs):
    """transformers' attention-interface call, computed by torch's SDPA on the CPU (`sdpa`):
    shared key/value heads read in place (``enable_gqa``, no ``repeat_kv`` copy), optionally
    in ``compute_dtype`` and returned in the query's dtype. Anything unusual
    (`leaves_to_transformers`) goes to transformers' own SDPA. The one wrapper of marscli's
    two CPU attentions: ``_gqa_sdpa_forward`` here and ``marscli.models.quant``'s float64
    attention for int8 models."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if leaves_to_transformers(query.device, kwargs):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    groups = getattr(module, "num_key_value_groups", 1)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    segments = kwargs.get("packed_segments")
    if segments and query.shape[0] == 1:
        # a packed prefill pass (marscli.models.prefill): each prompt's queries over its own
        # cached prefix and its own rest, causal; not every query over the whole row
        outs = []
        for q0, n, p0, m, k0 in segments:
            q = query[:, :, q0: q0 + n]
            k, v = key[:, :, k0: k0 + n], value[:, :, k0: k0 + n]
            seg_mask = None
            if m:
                k = torch.cat([key[:, :, p0: p0 + m], k], 2)
                v = torch.cat([value[:, :, p0: p0 + m], v], 2)
                seg_mask = torch.ones(n, m + n, dtype=torch.bool, device=query.device)
                seg_mask[:, m:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
                seg_mask = seg_mask[None, None]
            outs.append(sdpa(q, k, v, seg_mask, dropout, scaling, True, groups > 1, compute_dtype))
        return torch.cat(outs, 1), None
    runs = kwargs.get("row_runs")
    if runs and attention_mask is not None:
        # a slot cache's groups of rows (marscli.models.slots.row_runs), each over the columns
        # its rows can see: the same attention, reading each row's own length, not the longest
        return torch.cat([sdpa(query[a:b], key[a:b, :, :L], value[a:b, :, :L], attention_mask[a:b, :, :, :L],
                               dropout, scaling, bool(causal), groups > 1, compute_dtype)
                          for a, b, L in runs], 0), None
    return sdpa(query, key, value, attention_mask, dropout, scaling, bool(causal), groups > 1, compute_dtype), None


def _gqa_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' SDPA attention, minus the copy of the whole KV cache per layer per step.

    For grouped-query attention (SmolLM2: 9 query heads, 3 KV heads) transformers' CPU path
    `repeat_kv`s keys and values (a full copy of the cache) whenever a mask is given, and a
    batch with holes always gives one: at batch 8 that copy was 40% of a decode step. torch's
    SDPA takes `enable_gqa=True` and reads the shared heads in place: the same math
    (``cpu_sdpa_forward``)."""
    return cpu_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal, **kwargs)


def _install_gqa(model: nn.Module, name: str, forward) -> bool:
    """Register `forward` as attention `name` (with SDPA's mask) and switch a GQA model whose
    attention is "sdpa" to it; True if switched (models without shared heads stay)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not heads or kv_heads == heads:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(name, forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return True


def install_gqa_attention(model: nn.Module) -> bool:
    """Switch a CPU model from "sdpa" to the GQA-aware SDPA above; True if switched."""
    return _install_gqa(model, GQA_SDPA, _gqa_sdpa_forward)


#: The folded grouped-query attention's name in transformers' registries (accelerators).
GQA_FOLD = "marscli_gqa_fold"


def folded_gqa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
               scaling: Optional[float]) -> torch.Tensor:
    """Grouped-query attention with the query groups folded into the query axis: query
    [B, Hkv * G, S, D] viewed as [B, Hkv, G * S, D] against keys and values [B, Hkv, T, D],
    the mask [B, 1 or Hq, S, T] laid out the same way. Each key/value head is read once, by
    any SDPA kernel that takes a mask (transformers' SDPA path copies them G times with
    ``repeat_kv`` whenever a mask is given, which a batch over a padded cache always gives).
    Returns [B, S, Hq, D] in the query's dtype."""
    B, Hq, S, D = query.shape
    Hkv, T = key.shape[1], key.shape[2]
    G = Hq // Hkv
    q = query.reshape(B, Hkv, G * S, D)  # head h = kv * G + g, as repeat_kv lays them out
    m = None
    if mask is not None:
        if mask.shape[1] == 1:
            m = mask.unsqueeze(2).expand(B, 1, G, S, T).reshape(B, 1, G * S, T)
        else:
            m = mask.reshape(B, Hkv, G * S, T)
    out = F.scaled_dot_product_attention(q, key, value, attn_mask=m, scale=scaling)  # [B, Hkv, G*S, D]
    return out.reshape(B, Hq, S, D).transpose(1, 2).contiguous()


def _gqa_fold_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-interface call through ``folded_gqa`` where it applies (a
    mask given, or one query token; no dropout or extras), else transformers' own SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    plain = (dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap") is not None
             or bool(kwargs.get("output_attentions", False))
             or (attention_mask is None and query.shape[2] > 1))
    if plain or attention_mask is not None and attention_mask.dim() != 4:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    return folded_gqa(query, key, value, attention_mask, scaling), None


def install_folded_gqa_attention(model: nn.Module) -> bool:
    """Switch an accelerator model from "sdpa" to the folded GQA attention above (its
    verification steps then read each shared key/value head once); True if switched."""
    return _install_gqa(model, GQA_FOLD, _gqa_fold_forward)


def install_cpu_fastpath(model: nn.Module, packed: bool | None = None) -> int:
    """Patch the float32 CPU linear layers of `model` and its GQA attention; returns how many
    linear layers were patched. `packed` (default: where oneDNN has it, unless the environment
    sets MARSCLI_CPU_PACKED=0) keeps a second, reordered copy of each weight for products of 3
    rows or more: it doubles the memory of the linear weights."""
    packed = packed_enabled() if packed is None else packed and packed_available()
    small = small_rows()
    install_gqa_attention(model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = 0
    for mod in model.modules():
        if type(mod) is not nn.Linear:  # quantized or custom layers keep their own kernels
            continue
        if mod.weight.device.type != "cpu" or mod.weight.dtype != torch.float32:
            continue
        lo, hi = HEAD_ROWS if mod is head else BODY_ROWS
        _patch(mod, lo, hi, packed, small)
        n += 1
    return n
