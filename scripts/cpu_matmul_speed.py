"""One decode matmul (1 x 896 by 4864 x 896, Qwen2.5-0.5B's gate projection) on CPU: bf16
and float32 F.linear beside the compressed layers' CPU paths, median of 50 calls.

    python scripts/cpu_matmul_speed.py [THREADS]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kamado.surgery import formats
from kamado.surgery.qlinear import Int4Linear, Int8Linear


def median_ms(fn, n: int = 50) -> float:
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
    w = torch.randn(4864, 896) * 0.02
    layers = {
        "int8 per row (torch kernel, bf16)": Int8Linear(*formats.quantize_int8(w), None),
        "int8 group 32 (float32 tiles)": Int8Linear(*formats.quantize_int8(w, 32), None),
        "int4 group 128 (torch kernel, bf16)": Int4Linear(*formats.quantize_int4(w, 128), None),
    }
    print(f"threads {torch.get_num_threads()}")
    for dtype in (torch.bfloat16, torch.float32):
        x, wd = torch.randn(1, 896, dtype=dtype), w.to(dtype)
        print(f"{str(dtype):16s} F.linear {median_ms(lambda x=x, wd=wd: F.linear(x, wd)):7.2f} ms")
        for name, layer in layers.items():
            print(f"{str(dtype):16s} {name} {median_ms(lambda m=layer, x=x: m(x)):7.2f} ms")


if __name__ == "__main__":
    main()
