"""Time torch's CPU matrix-product paths on a model's layer shapes, float32 against int8.

    python scripts/int8_kernels.py                       # Qwen2.5-Coder-1.5B's shapes
    python scripts/int8_kernels.py --shapes 576x576,1536x576,576x1536,576x49152 --rows 1,2,9
    python scripts/int8_kernels.py --saturation          # the 8-bit vs 7-bit input grid check

Prints, per shape (input x output features) and row count, the best of --rounds calls in ms:
- f32: F.linear on float32 weights (marscli's packed/padded fast path is in
  scripts/fastpath_costs.py);
- int8 (marscli): `marscli.models.quant.Int8Linear`, fbgemm with rows quantized alone in two
  7-bit levels (what `--quant int8` runs);
- fbgemm-dyn: torch's dynamic int8 linear (one scale for the whole input: not row-exact);
- fp16: fbgemm's float16-weight linear;
- w8-pack: `torch._weight_int8pack_mm` (int8 weights, float inputs; torchao's int8
  weight-only path on CPU);
- int_mm: `torch._int_mm` (int8 x int8 -> int32; torchao's dynamic int8 path on CPU), at
  rows padded to 17 (its minimum);
and Int8Linear's relative error against float32. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
from torch import nn
from torch.nn import functional as F

from marscli.models.quant import X_SCALE, X_ZERO, Int8Linear

QWEN_1_5B = "1536x2048,1536x1536,1536x17920,8960x1536,1536x151936"


def best_ms(fn, rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def kernels(shapes: str, rows: list[int], rounds: int) -> None:
    warnings.simplefilter("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    cols = ["f32", "int8 (marscli)", "fbgemm-dyn", "fp16", "w8-pack", "int_mm"]
    print(f"| in x out | rows | {' | '.join(cols)} | int8 rel. error |")
    print("| --- | --- |" + " --- |" * (len(cols) + 1))
    for shape in shapes.split(","):
        i, o = (int(v) for v in shape.lower().split("x"))
        torch.manual_seed(0)
        lin = nn.Linear(i, o, bias=False)
        w = lin.weight.detach()
        q = Int8Linear(lin)
        scale = w.abs().amax(1) / 127
        qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(o, dtype=torch.long), 0, torch.qint8)
        dyn = torch.ops.quantized.linear_prepack(qw, None)
        f16 = torch.ops.quantized.linear_prepack_fp16(w, None)
        w8 = torch.round(w / scale[:, None]).to(torch.int8)
        wt = w8.t().contiguous()
        for r in rows:
            x = torch.randn(r, i)
            xi = torch.randint(-127, 127, (max(r, 17), i), dtype=torch.int8)
            t, err = _row_times(x, xi, w, q, dyn, f16, w8, scale, wt, rounds)
            print(f"| {i}x{o} | {r} | " + " | ".join(f"{v:.2f}" for v in t) + f" | {err:.4f} |", flush=True)


def _row_times(x, xi, w, q, dyn, f16, w8, scale, wt, rounds: int) -> tuple[list[float], float]:
    with torch.no_grad():
        ref = F.linear(x, w)
        err = float((q(x) - ref).norm() / ref.norm())
        return [best_ms(lambda: F.linear(x, w), rounds), best_ms(lambda: q(x), rounds),
                best_ms(lambda: torch.ops.quantized.linear_dynamic(x, dyn, True), rounds),
                best_ms(lambda: torch.ops.quantized.linear_dynamic_fp16(x, f16), rounds),
                best_ms(lambda: torch._weight_int8pack_mm(x, w8, scale), max(1, rounds // 4)),
                best_ms(lambda: torch._int_mm(xi, wt), 1)], err


def saturation() -> None:
    """fbgemm against exact integer arithmetic, 8-bit (zero 128) and 7-bit (marscli's) grids."""
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    w = torch.sign(torch.randn(512, 1536)) * 0.02  # every weight at full scale: the worst case
    scale = w.abs().amax(1) / 127
    qw = torch.quantize_per_channel(w, scale.double(), torch.zeros(512, dtype=torch.long), 0, torch.qint8)
    packed = torch.ops.quantized.linear_prepack(qw, None)
    x = torch.randn(4, 1536)
    x = x / x.abs().amax(1, keepdim=True)
    for name, s, z in (("8-bit, zero 128", 2 / 255, 128), ("7-bit, zero 64 (marscli)", X_SCALE, X_ZERO)):
        y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(x, s, z, packed).double()
        qx = torch.clamp(torch.round(x.double() / s) + z, 0, 255)
        exact = ((qx - z) * s) @ qw.dequantize().double().T
        print(f"{name}: largest error {float((y - exact).abs().max() / exact.abs().max()):.2e} of the largest output")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=QWEN_1_5B, help="comma-separated INxOUT (default: Qwen2.5-Coder-1.5B's)")
    ap.add_argument("--rows", default="1,2,3,5,9", help="row counts (default 1,2,3,5,9)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--saturation", action="store_true", help="only the input-grid saturation check")
    a = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    if a.saturation:
        saturation()
    else:
        kernels(a.shapes, [int(r) for r in a.rows.split(",")], a.rounds)


if __name__ == "__main__":
    main()
