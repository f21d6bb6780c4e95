"""CPU fast path for the few-row matrix products of speculative verification.

On x86 CPUs, torch's `F.linear` for an input of 2-3 rows streams the weight matrix from
memory once per row, so verifying 1-2 drafts costs ~1.7x a 1-token forward. Written as
`W @ x.T` the same product reads the weights once. Measured on this project's 2-core AVX2
CPU with the embedded SmolLM2-135M (float32, 600-token context, ms per forward):

| tokens            | 1  | 2   | 3   | 4  | 5  | 6  | 8  |
| plain F.linear    | 56 | 103 | 117 | 97 | 79 | 90 | 92 |
| with this patch   | 57 | 52  | 58  | 72 | 66 | 68 | 72 |

The patch applies to float32 nn.Linear modules on the CPU only: the lm_head for 2-32 rows
(its 49152 x 576 matrix dominates), other layers for 2-3 rows (from 4 rows on, the BLAS
kernel already reads the weights once). It changes summation order, not the math: results
agree with F.linear to float32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn

HEAD_ROWS = (2, 32)
BODY_ROWS = (2, 3)
_PATCHED = "_marscli_fastpath"


def _patch(linear: nn.Linear, lo: int, hi: int) -> None:
    if getattr(linear, _PATCHED, False):
        return
    plain = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if lo <= rows <= hi:
            w = linear.weight
            y = (w @ x.reshape(rows, x.shape[-1]).T).T
            if linear.bias is not None:
                y = y + linear.bias
            return y.reshape(*x.shape[:-1], w.shape[0])
        return plain(x)

    linear.forward = forward
    setattr(linear, _PATCHED, True)


def install_cpu_fastpath(model: nn.Module) -> int:
    """Patch the float32 CPU linear layers of `model`; returns how many were patched."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    n = 0
    for mod in model.modules():
        if type(mod) is not nn.Linear:  # quantized or custom layers keep their own kernels
            continue
        if mod.weight.device.type != "cpu" or mod.weight.dtype != torch.float32:
            continue
        lo, hi = HEAD_ROWS if mod is head else BODY_ROWS
        _patch(mod, lo, hi)
        n += 1
    return n
