"""Bytes per second of the CUDA int8/fp8 GEMV (triton_matmul._rowwise_kernel, a scale per
row), of the int4 GEMVs (int4_gemv_kernel for one input row, int4_gemv_rows_kernel
for two to four; group 128) and of the int4 kernel on mma.sync (FORMAT int4-mma,
int4_mma_kernel) for each tile configuration, at
Qwen3-8B's projection shapes: what the autotuner chooses among, so the list it gets can be
the configurations that win somewhere. bf16 weights (no scales:
triton_matmul.dense_matmul) run beside cuBLAS, whose figure for the shape is printed
first. The last shape is the output head.

    python scripts/gemv_sweep.py [ROWS [FORMAT ...]] [--pdl-only]
"""

from __future__ import annotations

import itertools
import sys

import torch
import triton
from dot_sweep import int4_weights
from dot_sweep import tb_per_s as all_bytes_per_s
from gemv_bandwidth import ROTATED_BYTES, graph_ms

from kamado.pdl import launch_options
from kamado.surgery import formats, int4_gemv, int4_tensor_cores
from kamado.surgery import triton_matmul as tm

SHAPES = [(6144, 4096), (4096, 4096), (4096, 12288), (24576, 4096), (151936, 4096)]
# (BLOCK_N, BLOCK_K, num_warps, SPLIT_K, STEP_SUMS)
CONFIGS = [
    (8, 512, 4, 1, False), (4, 1024, 4, 1, False), (16, 512, 4, 8, False),
    (4, 4096, 4, 1, True), (8, 4096, 4, 1, True), (8, 4096, 8, 1, True),
    (2, 4096, 4, 1, True), (4, 4096, 8, 1, True), (16, 4096, 8, 1, True),
    (4, 2048, 4, 1, True), (8, 2048, 4, 1, True), (16, 2048, 8, 1, True),
    (2, 2048, 2, 1, True), (4, 2048, 4, 2, True), (8, 2048, 4, 2, True),
    (4, 4096, 4, 2, True), (8, 1024, 4, 1, True), (4, 1024, 4, 4, True),
]  # fmt: skip
# int4, one row: (BLOCK_N, a multiple of 4, GROUPS_PER_STEP, num_warps)
INT4_CONFIGS = [
    (4, 32, 4), (8, 32, 4), (8, 16, 4), (8, 16, 2), (4, 8, 1), (8, 8, 2), (8, 8, 1),
    (16, 8, 4), (4, 4, 1), (8, 4, 1), (16, 4, 2), (16, 4, 4), (32, 4, 4),
]  # fmt: skip
# int4 on mma.sync (int4_mma_kernel), up to 8 rows: (num_warps, STAGES), the grid the
# autotuner's list (triton_matmul._INT4_MMA_CONFIGS) was picked from
INT4_MMA_CONFIGS = list(itertools.product((2, 4, 8, 16), (1, 2, 3, 4)))
# int4, two to four rows: (GROUPS_PER_STEP, num_warps)
INT4_ROWS_CONFIGS = [
    (4, 1), (8, 1), (4, 2), (8, 2), (16, 2), (32, 2), (8, 4), (16, 4), (32, 4), (16, 8), (32, 8),
]  # fmt: skip


def rowwise_tb_per_s(config: tuple, pdl: bool, k: int, copies: list, x: torch.Tensor) -> float:
    """Weight bytes read per second by the kernel in one configuration, rotated over copies,
    each call launched with programmatic dependent launch (kamado.pdl) or without."""
    bn, bk, warps, split, sums = config
    options = launch_options(x.device) if pdl else {"PDL": False}
    n, rows = copies[0][0].shape[0], x.shape[0]
    if split > 1 and n > tm.SPLIT_MAX_OUT:
        return float("nan")
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def call(q: torch.Tensor, scales: torch.Tensor | None) -> None:
        tm._rowwise_kernel[(triton.cdiv(n, bn), rows, split)](
            x, q, tm._optional_arg(x, scales), x, out, *tm.split_buffers(x.device), n,
            x.stride(0), q.stride(0), 0, out.stride(0), K=k, GROUP=k,
            HAS_SCALE=scales is not None, HAS_BIAS=False, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split,
            STEP_SUMS=sums, GATED=False, num_warps=warps, **options,
        )  # fmt: skip

    ms = graph_ms([lambda w=w: call(*w) for w in copies])
    return copies[0][0].nbytes / (ms / 1e3)


def int4_tb_per_s(config: tuple, pdl: bool, k: int, copies: list, x: torch.Tensor) -> float:
    """As rowwise_tb_per_s, for the int4 GEMVs; their bytes count the scales and minimums."""
    options = launch_options(x.device) if pdl else {"PDL": False}
    n, rows = copies[0][0].shape[0], x.shape[0]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def call(words: torch.Tensor, scale_mins: torch.Tensor) -> None:
        strides = x.stride(0), words.stride(0), scale_mins.stride(0), out.stride(0)
        tensors = x, words, scale_mins, x, out
        if rows == 1:
            bn, groups, warps = config
            int4_gemv.int4_gemv_kernel[(triton.cdiv(n, bn), rows)](
                *tensors, n, *strides, K=k, GROUP=128, HAS_BIAS=False, BLOCK_N=bn,
                GROUPS_PER_STEP=groups, GATED=False, num_warps=warps, **options,
            )  # fmt: skip
        else:
            groups, warps = config
            int4_gemv.int4_gemv_rows_kernel[(triton.cdiv(n, 4),)](
                *tensors, rows, n, *strides, K=k, GROUP=128, HAS_BIAS=False,
                GROUPS_PER_STEP=groups, ROWS=triton.next_power_of_2(rows), num_warps=warps,
                **options,
            )  # fmt: skip

    return all_bytes_per_s(call, copies)


def int4_mma_tb_per_s(config: tuple, pdl: bool, k: int, copies: list, x: torch.Tensor) -> float:
    """As int4_tb_per_s, for the int4 kernel on mma.sync."""
    warps, stages = config
    options = launch_options(x.device) if pdl else {"PDL": False}
    n, rows = copies[0][0].shape[0], x.shape[0]
    out = torch.empty(rows, n, device="cuda", dtype=torch.bfloat16)

    def call(words: torch.Tensor, scale_mins: torch.Tensor) -> None:
        int4_tensor_cores.int4_mma_kernel[(triton.cdiv(n, 16),)](
            x, words, scale_mins, x, out, rows, n, x.stride(0), words.stride(0),
            scale_mins.stride(0), out.stride(0), K=k, GROUP=128, HAS_BIAS=False, WARPS=warps,
            STAGES=stages, num_warps=warps, **options,
        )  # fmt: skip

    return all_bytes_per_s(call, copies)


def cublas_tb_per_s(copies: list, x: torch.Tensor) -> float:
    ms = graph_ms([lambda w=w: x @ w[0].T for w in copies])
    return copies[0][0].nbytes / (ms / 1e3)


def unquantized(w: torch.Tensor) -> tuple[torch.Tensor, None]:
    return w.to(torch.bfloat16), None


def main() -> None:
    args = sys.argv[1:]
    pdl_modes = (True,) if "--pdl-only" in args else (False, True)
    args = [a for a in args if a != "--pdl-only"]
    rows = int(args[0]) if args else 1
    rowwise = "(BLOCK_N, BLOCK_K, warps, split, sums)"
    swept = {  # format: (its tensors from a bf16 weight, the timing, configs, their fields)
        "fp8": (formats.quantize_fp8, rowwise_tb_per_s, CONFIGS, rowwise),
        "int8": (formats.quantize_int8, rowwise_tb_per_s, CONFIGS, rowwise),
        "bf16": (unquantized, rowwise_tb_per_s, CONFIGS, rowwise),
        "int4": (int4_weights, int4_tb_per_s, INT4_CONFIGS, "(BLOCK_N, GROUPS_PER_STEP, warps)")
        if rows == 1
        else (int4_weights, int4_tb_per_s, INT4_ROWS_CONFIGS, "(GROUPS_PER_STEP, warps)"),
        "int4-mma": (int4_weights, int4_mma_tb_per_s, INT4_MMA_CONFIGS, "(warps, STAGES)"),
    }
    for name in args[1:] or swept:
        quantize, tb_per_s, configs, fields = swept[name]
        print(f"{name}, input rows {rows}: TB/s of weight bytes per config")
        shapes = " ".join(f"{n:>5d}x{k:<5d}" for n, k in SHAPES)
        print(f"{fields:>38s} | {shapes}")
        copies = {}
        for n, k in SHAPES:
            tensors = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02)
            count = max(2, -(-ROTATED_BYTES // tensors[0].nbytes))
            copies[n, k] = [
                tuple(None if t is None else t.clone() for t in tensors) for _ in range(count)
            ]
        x = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for _, k in SHAPES}
        if name == "bf16":
            cublas = [cublas_tb_per_s(copies[n, k], x[k]) for n, k in SHAPES]
            print(f"{'cuBLAS':>38s} | " + " ".join(f"{c / 1e12:11.2f}" for c in cublas))
        for config, pdl in itertools.product(configs, pdl_modes):
            cells = []
            for n, k in SHAPES:
                try:
                    tb_s = tb_per_s(config, pdl, k, copies[n, k], x[k])
                    cells.append(f"{tb_s / 1e12:11.2f}")
                except Exception as error:  # noqa: BLE001 - a config that does not build
                    cells.append(f"{type(error).__name__[:11]:>11s}")
            label = f"{config!s}{' pdl' if pdl else ''}"
            print(f"{label:>38s} | " + " ".join(cells), flush=True)
        del copies
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
