"""Bytes per second of each compressed linear's decode matmul on CUDA at Qwen3-8B and
Llama-3-70B projection shapes, beside a bf16 nn.Linear: the kernels alone, without the engine.

Each cell times calls captured in one CUDA graph (as the engine replays decode steps, so
no launch cost), over enough copies of the weight that none is still in L2 when read again.

    python scripts/gemv_bandwidth.py [ROWS] [--model qwen3-8b] [--tiled-max-rows N]

--tiled-max-rows sets triton_matmul.TILED_MAX_ROWS, up to which inputs wider than one tile
run as slices through the tile kernels instead of widening the weight: run it twice, at
16 (no slices) and at the default, for the A/B of the two at ROWS past 16.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from kamado.bench.gpu import copy_bandwidth
from kamado.surgery import formats
from kamado.surgery import triton_matmul as tm
from kamado.surgery.pipeline import module_bytes
from kamado.surgery.qlinear import Fp8Linear, Int4Linear, Int8Linear

SHAPES = {
    "qwen3-8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288), (151936, 4096)],
    "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)],
}
ROTATED_BYTES = 400 * 2**20  # several times the H200's 50 MB of L2


def graph_ms(calls: list[Callable[[], object]], reps: int = 20) -> float:
    """Median device time of one call, all of them captured in one graph and replayed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (and Triton's tuning) outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[reps // 2] / len(calls)


def bytes_per_second(make: Callable[[], torch.nn.Module], x: torch.Tensor) -> float:
    """Weight bytes read per second by make()'s module, rotated over fresh copies."""
    first = make()
    size = module_bytes(first)
    modules = [first] + [make() for _ in range(max(1, -(-ROTATED_BYTES // size) - 1))]
    ms = graph_ms([lambda m=m: m(x) for m in modules])
    return size / (ms / 1e3)


class TorchInt4(torch.nn.Module):
    """torch's own CUDA int4 matmul (aten._weight_int4pack_mm, group 128) as a peer for
    Int4Linear: the same values, in the layout that kernel wants."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        super().__init__()
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack(pairs, 8))
        s = scales.float()  # torch computes w = (q - 8) * scale + zero
        zeros = torch.stack([s, mins.float() + 8 * s], dim=-1).transpose(0, 1)
        self.register_buffer("scale_zeros", zeros.contiguous().to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm(x, self.packed, 128, self.scale_zeros)


def format_makers(w: torch.Tensor) -> list[Callable[[], torch.nn.Module]]:
    """bf16, int8 (a scale per row), fp8, int4 (group 128; ours, then torch's), and int8 and
    int4 in groups of 32 (as GGUF's Q8_0 and 4-bit types load) linears of w, each call a
    fresh copy."""
    n, k = w.shape
    int8, fp8, int4 = formats.quantize_int8(w), formats.quantize_fp8(w), formats.quantize_int4(w)
    int8_g32, int4_g32 = formats.quantize_int8(w, 32), formats.quantize_int4(w, 32)

    def bf16() -> torch.nn.Module:
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        linear.weight.data.copy_(w)
        return linear

    return [
        bf16,
        lambda: Int8Linear(int8[0].clone(), int8[1], None),
        lambda: Fp8Linear(fp8[0].clone(), fp8[1], None),
        lambda: Int4Linear(int4[0], int4[1], int4[2], None),
        lambda: TorchInt4(*int4),
        lambda: Int8Linear(int8_g32[0].clone(), int8_g32[1], None),
        lambda: Int4Linear(int4_g32[0], int4_g32[1], int4_g32[2], None),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rows", type=int, nargs="?", default=1, help="input rows")
    parser.add_argument("--model", choices=sorted(SHAPES), help="one model's shapes (default both)")
    parser.add_argument("--tiled-max-rows", type=int, default=tm.TILED_MAX_ROWS)
    args = parser.parse_args()
    rows = args.rows
    tm.TILED_MAX_ROWS = args.tiled_max_rows
    bandwidth = copy_bandwidth()
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; input rows {rows}; TILED_MAX_ROWS "
        f"{tm.TILED_MAX_ROWS}; TB/s of weight bytes"
    )
    columns = ["bf16", "int8", "fp8", "int4", "torch4", "int8g32", "int4g32"]
    print(f"{'shape':>14s} " + " ".join(f"{c:>7s}" for c in columns))
    models = [args.model] if args.model else list(SHAPES)
    for n, k in [shape for model in models for shape in SHAPES[model]]:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        cells = [bytes_per_second(make, x) for make in format_makers(w)]
        print(f"{n:>7d}x{k:<6d} " + " ".join(f"{c / 1e12:7.2f}" for c in cells), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
