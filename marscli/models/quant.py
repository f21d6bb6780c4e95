"""int8 weights on the CPU: fbgemm's int8 matrix product, with every row quantized alone.

Decoding is memory-bound: a token costs the bytes of weights it reads. float32 reads 4 bytes
per weight; this module swaps each `nn.Linear` (the lm_head included) for `Int8Linear`,
which holds the weight as int8 with one scale per output channel (symmetric, round to
nearest), packed once into fbgemm's layout, and reads a quarter of the bytes.

The activations are quantized too (fbgemm multiplies uint8 by int8 into int32), but **per
row** and in **two levels**. Each row is divided by its own largest magnitude over 63, so it
lies in [-63, 63]; `hi` is that rounded to integers (7 bits), `lo` is what rounding missed
(at most 1/2) times 63, rounded in turn; both go through one product as 2m rows, and
y = (W hi + W lo / 63) x scale: 12-13 bits of input for the price of one read of the
weights (a product of 2 rows costs about what 1 costs). With one 7-bit level, SmolLM2-135M's
next-token distribution moved by a KL of 0.107 nats from float32 (top-1 agreement 86%); with
the two levels by 0.0028 (97%), as with int8 weights and float inputs.

The price of the second level is arithmetic, not bytes: k + 1 verified tokens are 2(k + 1)
rows of the product, and at 18 rows fbgemm on two AVX2 cores is compute-bound (a 9-token
forward of Qwen2.5-Coder-1.5B cost 2.6x a 1-token one, against ~1x with float32's packed
kernel). One level would halve that, at a KL of 0.0063 instead of 0.0002 on that model
(lab/benchmarks-history.md, "int8 weights on the CPU").

Why per row: fbgemm's own dynamic linear chooses one scale for the whole input, so a token's
result would depend on the other tokens of the forward (the drafts verified beside it, the
rows of a batch), and strict verification of 9 drafts would not reproduce plain decoding.
Here integer accumulation is exact, the grid is fixed and the scale is the row's own, so a
row's output is the same bits whoever its neighbours are (tests/models/test_quant.py).

The grid uses 7 of uint8's 8 bits (1..127, zero at 64). On CPUs without VNNI fbgemm
multiplies with `vpmaddubsw`, which sums two uint8 x int8 products into int16 and saturates:
two full-range products (255 x 127 x 2) overflow, 127 x 127 x 2 do not. Measured on this
project's AVX2 CPU against exact integer arithmetic (`lab/scripts/int8_kernels.py --saturation`):
an 8-bit grid (zero at 128) was off by 8-90% of the largest output, the 7-bit grid by 1e-7
(float rounding). fbgemm's own `reduce_range` exists for the same reason. The one grid is
used on every CPU, so the int8 model is the same function everywhere.

torch's other CPU paths, timed on the pair's layer shapes on this project's AVX2 CPU
(`python lab/scripts/int8_kernels.py`; lab/benchmarks-history.md has the table): `_weight_int8pack_mm`
(int8 weights, float inputs: the eager CPU kernel of int8 weight-only linear layers) was
3-30x slower than float32, `torch._int_mm` (int8 x int8) 60-80x slower, oneDNN's
`qlinear_pointwise` 3-5x slower than this path, fbgemm's float16-weight linear about 1.7x
slower than this path.
"""

from __future__ import annotations

import functools
import warnings
from typing import Optional

import torch
from torch import nn

from marscli.models.fastpath import cpu_sdpa_forward

#: The activation grid: a row scaled into [-1, 1] maps to uint8 64 +- 63.
X_LEVELS = 63
X_ZERO = 64
X_SCALE = 1.0 / X_LEVELS
TINY = torch.finfo(torch.float32).tiny
LEVELS = torch.tensor(float(X_LEVELS))  # X_LEVELS as a 0-dim float32 tensor
#: The identity label of this quantization (profiles, result spec, fingerprints, cost cache).
CPU_INT8 = "int8-cpu-w8a7x2"


def int8_available() -> bool:
    """Whether this torch build has fbgemm's int8 linear with a given input grid."""
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32  # noqa: B018
        torch.ops.quantized.linear_prepack  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def int8_product(x: torch.Tensor, packed: torch.classes.quantized.LinearPackedParamsBase,
               bias: Optional[torch.Tensor], levels: torch.Tensor, tiny: float, scale: float, zero: int,
               out_features: int) -> torch.Tensor:
    """`Int8Linear`'s product: x's rows quantized alone in two levels, times the packed
    weight. TorchScript-compatible (`scripted_int8_product` runs it scripted; the ops are the same)."""
    # In place in one buffer, and a tensor constant for the levels: each op costs dispatch
    # time, as much as the product of a small layer.
    x2 = x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.to(torch.float32)
    m = x2.shape[0]
    # Each row in units of its own largest magnitude / X_LEVELS: t in [-X_LEVELS, X_LEVELS].
    # (abs + amax, not vector_norm's inf norm: the same exact maxima, and the norm ran 5-9x
    # slower for 9-141 rows: 11 of a 9-token forward's 200 ms on Qwen2.5-Coder-1.5B)
    step = x2.abs().amax(dim=1, keepdim=True).clamp_min_(tiny).div_(levels)
    buf = torch.empty([2 * m, x2.shape[1]])
    hi = buf[:m]
    lo = buf[m:]
    t = torch.div(x2, step, out=lo)
    torch.round(t, out=hi)  # integers: quantized exactly
    # What the grid missed, |t - hi| <= 1/2, times X_LEVELS (room for hi one level off),
    # quantized on the same grid: 12-13 bits in all.
    lo.sub_(hi).mul_(levels)
    y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(buf, 1.0, zero, packed)
    out = torch.add(y[:m], y[m:], alpha=scale).mul_(step)
    if bias is not None:
        out.add_(bias)
    shape = list(x.shape[:-1])
    shape.append(out_features)
    return out.view(shape)


def script(fn):
    """`fn` compiled by TorchScript, or `fn` itself where this torch cannot script it.

    Same ATen kernels in the same order, so the same bits either way; the interpreter only
    skips Python's cost per op (a decoder layer of an int8 model runs ~130 small ops around
    its 4 products, and Python's share of them was a third of a 1-token forward of
    Qwen2.5-Coder-0.5B). torch deprecates `torch.jit.script` in favour of `torch.compile`,
    which is no use here (lab/benchmarks-history.md: recompiles on the KV cache, ~2 s a forward,
    not row-exact); if a future torch drops it, the plain functions run."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.jit.script(fn)
    except Exception:  # noqa: BLE001 - any failure to script means: run the Python function
        return fn


@functools.cache
def scripted_int8_product():
    """`int8_product`, scripted once per process on first use."""
    return script(int8_product)


class Int8Linear(nn.Module):
    """A frozen `nn.Linear` with int8 weights (per output channel) and per-row inputs.

    Several linear layers that read the same input (q/k/v, gate/up) can share one packed
    matrix (`fuse`): the first to see an input computes all of them in one product, the
    others take their slices. Per output channel the arithmetic is the same either way."""

    def __init__(self, linear: nn.Linear | list[nn.Linear]) -> None:
        super().__init__()
        parts = linear if isinstance(linear, list) else [linear]
        w = torch.cat([p.weight.detach().to(torch.float32) for p in parts])
        self.in_features, self.out_features = int(w.shape[1]), int(w.shape[0])
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        with warnings.catch_warnings():  # quantized tensors are "deprecated"; fbgemm is not
            warnings.simplefilter("ignore")
            qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long),
                                            0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qw, None)
        biases = [p.bias for p in parts]
        bias = (None if all(b is None for b in biases) else torch.cat([
            torch.zeros(p.out_features) if b is None else b.detach().float() for p, b in zip(parts, biases)]))
        self.register_buffer("bias", bias)
        #: Bytes a forward reads from the packed weight (int8) and the scales.
        self.weight_bytes = w.numel() + 4 * w.shape[0]
        self._last: tuple | None = None  # (input, its version, output) for shared layers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scripted_int8_product()(x, self._packed, self.bias, LEVELS, TINY, X_SCALE, X_ZERO, self.out_features)

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """forward(x), computed once for consecutive calls with the same unchanged input."""
        # Inference tensors keep no version counter; nothing writes to a layer's input
        # between its siblings' calls in a decoder layer.
        version = None if x.is_inference() else x._version
        last = self._last
        if last is not None and last[0] is x and last[1] == version:
            return last[2]
        out = self.forward(x)
        self._last = (x, version, out)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 rowwise"


class Int8Slice(nn.Module):
    """One of several linear layers fused into a shared `Int8Linear`: its output columns."""

    def __init__(self, fused: Int8Linear, start: int, stop: int, last: bool) -> None:
        super().__init__()
        self.fused = [fused]  # a list: the fused layer is registered once, on the first slice
        self.start, self.stop, self.last = start, stop, last
        self.in_features, self.out_features = fused.in_features, stop - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = self.fused[0]
        out = fused.shared(x)[..., self.start:self.stop]
        if self.last:
            fused._last = None  # every sibling has taken its part
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, columns {self.start}:{self.stop}"


#: Sibling linear layers that read the same input in transformers' decoder layers.
FUSE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def quantize_int8(model: nn.Module, keep=None, fuse: bool = True) -> int:
    """Swap every float `nn.Linear` of a CPU model for int8, in place; the count swapped.

    Siblings in `FUSE_GROUPS` (same input width) share one packed matrix and one input
    quantization (`fuse`). The float weights of swapped layers are dropped (a tied lm_head
    keeps the embedding it shares). Modules are frozen: this is for inference."""
    # Names only, looked up one at a time: each float layer is freed as soon as it is swapped,
    # so the peak is the float model plus one layer's int8 copy, not both models.
    n = 0
    if fuse:
        parents = [name for name, mod in model.named_modules() if not isinstance(mod, nn.Linear)]
        for parent_name in parents:
            parent = model.get_submodule(parent_name) if parent_name else model
            for group in FUSE_GROUPS:
                mods = [getattr(parent, name, None) for name in group]
                names = [f"{parent_name}.{g}" if parent_name else g for g in group]
                if (not all(type(m) is nn.Linear for m in mods)
                        or len({m.in_features for m in mods}) != 1 or (keep and any(keep(nm) for nm in names))):
                    continue
                fused = Int8Linear(mods)
                widths = [m.out_features for m in mods]
                del mods
                start = 0
                for i, (name, width) in enumerate(zip(group, widths)):
                    piece = Int8Slice(fused, start, start + width, i == len(group) - 1)
                    if i == 0:
                        piece.add_module("packed", fused)
                    setattr(parent, name, piece)
                    start += width
                n += len(group)
    names = [name for name, mod in model.named_modules() if type(mod) is nn.Linear and not (keep and keep(name))]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, Int8Linear(getattr(parent, child)))
    return n + len(names)


def own_float_tensors(model: nn.Module) -> None:
    """Copy the float tensors a quantized model keeps into memory of their own.

    transformers maps a safetensors file into memory, and a float32 weight that needs no
    conversion stays a view of that mapping. Quantizing reads every weight once, so the whole
    file becomes resident; the int8 layers drop their float weights, but the tensors the model
    keeps as they are (the embedding, the norms, unfused biases) still view the mapping, and
    the mapping and every page read through it stay in the process while one of them does:
    `--draft self` with Qwen2.5-Coder-1.5B held 5.9 GB of file pages for a 0.9 GB embedding.
    Once copied, the last view goes and the file is unmapped."""
    for t in [*model.parameters(), *model.buffers()]:  # parameters() skips tied duplicates
        if t.device.type == "cpu" and t.is_floating_point():
            t.data = t.data.clone()


def output_rows(model: nn.Module) -> int:
    """Rows of a model's output projection (the width of its logits), float or int8;
    the config's vocab_size where there is none."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, Int8Linear):
        return head.out_features
    weight = getattr(head, "weight", None) if head is not None else None
    if weight is not None and weight.dim() == 2:
        return int(weight.shape[0])
    return int(model.config.vocab_size)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of a module's weights as held: parameters, plus int8 layers' packed weights."""
    n = sum(p.numel() * p.element_size() for p in module.parameters())
    return n + sum(m.weight_bytes for m in module.modules() if isinstance(m, Int8Linear))


# --------------------------------------------------------------------------- attention

#: Our float64 attention's name in transformers' registries (int8 CPU models).
F64_SDPA = "marscli_f64_sdpa"


def _f64_sdpa_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """Scaled dot-product attention computed in float64, returned in float32.

    An int8 model quantizes every linear layer's input, so a difference of one float32
    rounding in a layer's input can move an activation across a grid boundary, and the
    model's output by far more than a rounding. The linear layers here are exact per row; the
    attention is the one float computation whose summation order depends on how many queries
    a forward holds (1 in plain decoding, k + 1 in a verification). Computed in float64, the
    order's effect is ~1e-16, and the float32 result is the same bits unless a value falls
    within that of a float32 rounding boundary: strict speculative decoding of an int8 model
    then reproduces its plain decoding (tests/models/test_quant.py; measured in docs/results.md).
    """
    return cpu_sdpa_forward(module, query, key, value, attention_mask, dropout, scaling, is_causal,
                            compute_dtype=torch.float64, **kwargs)


def install_f64_attention(model: nn.Module) -> bool:
    """Switch an SDPA model's attention to `_f64_sdpa_forward`; True if switched."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(F64_SDPA, _f64_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(F64_SDPA, sdpa_mask)
    model.set_attn_implementation(F64_SDPA)
    return True
