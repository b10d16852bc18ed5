"""Bytes per second of the CUDA tensor-core matmuls over compressed weights
(triton_matmul.int4_dot_kernel and _scaled_dot_kernel) for each tile configuration, at
Qwen3-8B's projection shapes and the output head: what the autotuner chooses among, so
the list it gets can be the configurations that win somewhere.

    python scripts/dot_sweep.py [ROWS [FORMAT ...]]    (FORMAT: int4, fp8, int8, int8-g32)
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import triton
from gemv_bandwidth import ROTATED_BYTES, graph_ms

from kamado.pdl import launch_options
from kamado.surgery import formats, int4_tensor_cores
from kamado.surgery import triton_matmul as tm
from kamado.surgery.qlinear import Int4Linear

SHAPES = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)]
# int4: (BLOCK_N, GROUPS_PER_STEP, SWAP, num_warps, num_stages, SPLIT_K)
INT4_CONFIGS = [
    (64, 4, True, 4, 2, 1), (64, 4, True, 4, 3, 1), (128, 4, True, 8, 2, 1),
    (32, 4, False, 4, 3, 1), (64, 4, True, 4, 2, 2), (64, 4, True, 4, 2, 4),
    (64, 2, True, 4, 3, 4), (64, 2, True, 4, 3, 8), (64, 1, True, 4, 3, 8),
    (128, 2, True, 8, 3, 4), (128, 2, True, 8, 3, 8), (32, 4, False, 4, 3, 4),
    (32, 2, False, 4, 3, 8), (16, 4, False, 4, 3, 4), (16, 4, False, 4, 3, 8),
    (16, 2, False, 4, 3, 8), (64, 4, True, 4, 2, 8), (32, 4, True, 4, 3, 8),
]  # fmt: skip
# fp8 and int8, a scale per row or per group:
# (BLOCK_N, BLOCK_K, SWAP, num_warps, num_stages, SPLIT_K)
SCALED_CONFIGS = [
    (64, 256, False, 4, 3, 1), (128, 256, False, 4, 3, 1), (64, 256, False, 4, 4, 4),
    (64, 256, False, 4, 3, 8), (128, 128, False, 4, 4, 8), (64, 256, True, 4, 3, 1),
    (64, 512, True, 4, 3, 1), (128, 256, True, 4, 3, 1), (128, 256, True, 8, 3, 1),
    (64, 256, True, 4, 4, 1), (64, 128, True, 4, 5, 1), (64, 256, True, 4, 3, 2),
    (64, 256, True, 4, 4, 4), (64, 128, True, 4, 4, 8), (64, 512, True, 4, 3, 4),
    (128, 256, True, 4, 3, 4), (128, 128, True, 4, 4, 8), (64, 256, True, 4, 3, 8),
]  # fmt: skip


def int4_weights(w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    linear = Int4Linear(*formats.quantize_int4(w), None)  # the layout int4_matmul takes
    return linear.packed, linear.scale_mins


def int4_call(config: tuple, x: torch.Tensor, out: torch.Tensor) -> Callable[..., None]:
    bn, g, swap, warps, stages, split = config
    n, rows, k = out.shape[1], x.shape[0], x.shape[1]

    def call(words: torch.Tensor, scale_mins: torch.Tensor) -> None:
        int4_tensor_cores.int4_dot_kernel[(triton.cdiv(n, bn), split)](
            x, words, scale_mins, x, out, *tm.split_buffers(x.device), rows, n, x.stride(0),
            words.stride(0), scale_mins.stride(0), out.stride(0), K=k, GROUP=128,
            HAS_BIAS=False, BLOCK_N=bn, BLOCK_M=16, GROUPS_PER_STEP=g, SWAP=swap,
            SPLIT_K=split, num_warps=warps, num_stages=stages, **launch_options(x.device),
        )  # fmt: skip

    return call


def scaled_call(config: tuple, x: torch.Tensor, out: torch.Tensor) -> Callable[..., None]:
    bn, bk, swap, warps, stages, split = config
    n, rows, k = out.shape[1], x.shape[0], x.shape[1]

    def call(q: torch.Tensor, scales: torch.Tensor) -> None:
        scales = scales.view(n, -1)  # fp8's are [n]
        tm._scaled_dot_kernel[(triton.cdiv(n, bn), split)](
            x, q, scales, x, out, *tm.split_buffers(x.device), rows, n, x.stride(0),
            q.stride(0), scales.stride(0), out.stride(0), K=k, GROUP=k // scales.shape[1],
            HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, BLOCK_M=16, SWAP=swap, SPLIT_K=split,
            num_warps=warps, num_stages=stages, **launch_options(x.device),
        )  # fmt: skip

    return call


SWEPT = {  # format: (its tensors from a bf16 weight, a launch per config, the configs)
    "int4": (int4_weights, int4_call, INT4_CONFIGS),
    "fp8": (formats.quantize_fp8, scaled_call, SCALED_CONFIGS),
    "int8": (formats.quantize_int8, scaled_call, SCALED_CONFIGS),
    "int8-g32": (lambda w: formats.quantize_int8(w, 32), scaled_call, SCALED_CONFIGS),  # GGUF's
}


def tb_per_s(call: Callable[..., None], copies: list) -> float:
    """Weight bytes (with their scales) read per second by `call`, rotated over copies."""
    ms = graph_ms([lambda w=w: call(*w) for w in copies])
    return sum(t.nbytes for t in copies[0]) / (ms / 1e3)


def main() -> None:
    rows = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for name in sys.argv[2:] or SWEPT:
        make, launch, configs = SWEPT[name]
        print(f"{name}, input rows {rows}: TB/s of weight bytes per config (split: PDL on)")
        print(" " * 30 + "| " + " ".join(f"{n:>5d}x{k:<5d}" for n, k in SHAPES))
        copies = {}
        for n, k in SHAPES:
            tensors = make(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            count = max(2, -(-ROTATED_BYTES // sum(t.nbytes for t in tensors)))
            copies[n, k] = [tuple(t.clone() for t in tensors) for _ in range(count)]
        x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES}
        for config in configs:
            cells = []
            for n, k in SHAPES:
                out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)
                if config[-1] > 1 and n > tm.SPLIT_MAX_OUT:
                    cells.append(f"{'nan':>11s}")
                    continue
                try:
                    tb_s = tb_per_s(launch(config, x[k], out), copies[n, k])
                    cells.append(f"{tb_s / 1e12:11.2f}")
                except Exception as error:  # noqa: BLE001 - a config that does not build
                    cells.append(f"{type(error).__name__[:11]:>11s}")
            print(f"{config!s:>29s} | " + " ".join(cells), flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
