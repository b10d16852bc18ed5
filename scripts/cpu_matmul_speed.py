"""Decode- and prefill-sized matmuls over Qwen2.5-0.5B's fused gate/up weight (9728 x 896)
on CPU: bf16 F.linear beside each compressed layer as the engine runs it, and per-row int8's
two paths apart (torch's int8 kernel; the weight widened to bf16 tiles), median of 20
calls, in ms, at each count of input rows.

    python scripts/cpu_matmul_speed.py [THREADS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kamado.surgery import cpu_matmul, formats
from kamado.surgery.qlinear import Int4Linear, Int8Linear

ROWS = (1, 8, 64, 256)


def median_ms(fn, n: int = 20) -> float:
    fn()
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    if len(sys.argv) > 1:
        torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(0)
    w = torch.randn(9728, 896) * 0.02
    q, scales = formats.quantize_int8(w)
    kernel_scales = scales[:, 0].to(cpu_matmul.KERNEL_DTYPE)
    bf16 = w.to(torch.bfloat16)
    layers = {
        "bf16 F.linear": lambda x: F.linear(x, bf16),
        "int8 per row (engine)": Int8Linear(q, scales, None),
        "  int8 kernel": lambda x: torch.ops.aten._weight_int8pack_mm(x, q, kernel_scales),
        "  int8 widened": lambda x: cpu_matmul.int8_widened(x, q, kernel_scales),
        "int8 group 32 (engine)": Int8Linear(*formats.quantize_int8(w, 32), None),
        "int4 group 128 (engine)": Int4Linear(*formats.quantize_int4(w, 128), None),
    }
    print(f"threads {torch.get_num_threads()}; ms a call, 9728x896 weight, bf16 inputs")
    print(f"{'rows':26s}" + "".join(f"{r:>9d}" for r in ROWS))
    inputs = [torch.randn(r, 896, dtype=torch.bfloat16) for r in ROWS]
    for name, layer in layers.items():
        times = [median_ms(lambda m=layer, x=x: m(x)) for x in inputs]
        print(f"{name:26s}" + "".join(f"{t:9.2f}" for t in times), flush=True)


if __name__ == "__main__":
    main()
