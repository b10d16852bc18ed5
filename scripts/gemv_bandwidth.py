"""Bytes per second of each compressed linear's batch-1 matmul on CUDA at Qwen3-8B and
Llama-3-70B projection shapes, beside bf16 F.linear: the kernels alone, without the engine.

    python scripts/gemv_bandwidth.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kamado.bench.gpu import copy_bandwidth, timed_ms
from kamado.surgery import formats
from kamado.surgery.pipeline import module_bytes
from kamado.surgery.qlinear import Fp8Linear, Int4Linear, Int8Linear

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096), (57344, 8192)]


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; each cell: TB/s of weight bytes read")
    print(f"{'shape':>14s} {'bf16':>6s} {'int8':>6s} {'fp8':>6s} {'int4':>6s}")
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        modules = {
            "int8": Int8Linear(*formats.quantize_int8(w), None),
            "fp8": Fp8Linear(*formats.quantize_fp8(w), None),
            "int4": Int4Linear(*formats.quantize_int4(w, 128), None),
        }
        cells = [w.numel() * 2 / (timed_ms(lambda w=w, x=x: F.linear(x, w), 50) / 1e3)]
        for module in modules.values():
            ms = timed_ms(lambda m=module, x=x: m(x), 50)
            cells.append(module_bytes(module) / (ms / 1e3))
        print(f"{n:>7d}x{k:<6d} " + " ".join(f"{c / 1e12:6.2f}" for c in cells), flush=True)


if __name__ == "__main__":
    main()
