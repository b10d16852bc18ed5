"""Bytes per second of the CUDA int4 matmul (triton_matmul._int4_dot_kernel) for each
tile configuration, one input row, at Qwen3-8B's projection shapes: what the autotuner
chooses among, so the list it gets can be the configurations that win somewhere.

    python scripts/int4_sweep.py [ROWS]
"""

from __future__ import annotations

import sys

import torch
import triton
from gemv_bandwidth import ROTATED_BYTES, graph_ms

from kamado.pdl import launch_options
from kamado.surgery import formats
from kamado.surgery import triton_matmul as tm
from kamado.surgery.qlinear import Int4Linear

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
# (BLOCK_N, GROUPS_PER_STEP, SWAP, num_warps, num_stages, SPLIT_K)
CONFIGS = [
    (64, 4, True, 4, 2, 1), (64, 4, True, 4, 3, 1), (128, 4, True, 8, 2, 1),
    (32, 4, False, 4, 3, 1), (64, 4, True, 4, 2, 2), (64, 4, True, 4, 2, 4),
    (64, 2, True, 4, 3, 4), (64, 2, True, 4, 3, 8), (64, 1, True, 4, 3, 8),
    (128, 2, True, 8, 3, 4), (128, 2, True, 8, 3, 8), (32, 4, False, 4, 3, 4),
    (32, 2, False, 4, 3, 8), (16, 4, False, 4, 3, 4), (16, 4, False, 4, 3, 8),
    (16, 2, False, 4, 3, 8), (64, 4, True, 4, 2, 8), (32, 4, True, 4, 3, 8),
]  # fmt: skip


def tb_per_s(config: tuple, k: int, copies: list, x: torch.Tensor) -> float:
    """Weight bytes read per second by the kernel in one configuration, rotated over copies."""
    bn, g, swap, warps, stages, split = config
    n, rows = copies[0][0].shape[0], x.shape[0]
    if split > 1 and n > tm.SPLIT_MAX_OUT:
        return float("nan")
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def call(words: torch.Tensor, scale_mins: torch.Tensor) -> None:
        tm._int4_dot_kernel[(triton.cdiv(n, bn), split)](
            x, words, scale_mins, x, out, *tm.split_buffers(x.device), rows, n, x.stride(0),
            words.stride(0), scale_mins.stride(0), out.stride(0), K=k, GROUP=128,
            HAS_BIAS=False, BLOCK_N=bn, BLOCK_M=16, GROUPS_PER_STEP=g, SWAP=swap,
            SPLIT_K=split, num_warps=warps, num_stages=stages, **launch_options(x.device),
        )  # fmt: skip

    ms = graph_ms([lambda w=w: call(*w) for w in copies])
    return sum(t.nbytes for t in copies[0]) / (ms / 1e3)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    print(f"int4 group 128, input rows {rows}: TB/s of weight bytes per config")
    shapes = " ".join(f"{n:>5d}x{k:<5d}" for n, k in SHAPES)
    print(f"(BLOCK_N, groups a step, swap, warps, stages) | {shapes}")
    copies = {}
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        linear = Int4Linear(*formats.quantize_int4(w), None)  # the layout int4_matmul takes
        words, scale_mins = linear.packed, linear.scale_mins
        count = max(2, -(-ROTATED_BYTES // (words.nbytes + scale_mins.nbytes)))
        copies[n, k] = [(words.clone(), scale_mins.clone()) for _ in range(count)]
    x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES}
    for config in CONFIGS:
        cells = []
        for n, k in SHAPES:
            try:
                cells.append(f"{tb_per_s(config, k, copies[n, k], x[k]) / 1e12:11.2f}")
            except Exception as error:  # noqa: BLE001 - a config that does not build
                cells.append(f"{type(error).__name__[:11]:>11s}")
        print(f"{config!s:>28s} | " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
