"""Matmuls over compressed weights on CPU.

Per-row int8 and grouped int4 use torch's own packed-weight kernels (the ones gpt-fast
uses), which read the compressed bytes directly. Those are built for bf16 activations,
so they always run in bf16, scales included, and cast the result back (one thread, a
4864x896 decode matmul: 0.24 ms against 0.34 ms for bf16 F.linear;
scripts/cpu_matmul_speed.py). Other layouts (grouped int8 from GGUF) dequantize a few
hundred rows at a time into float32 tiles, so a full-precision copy of the matrix never
exists.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE_ROWS = 256
KERNEL_DTYPE = torch.bfloat16  # what torch's packed-weight CPU kernels are fast in


def int8_rowwise(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ (q * scales).T for per-row scales [out] in KERNEL_DTYPE."""
    y = torch.ops.aten._weight_int8pack_mm(x.to(KERNEL_DTYPE), q, scales)
    return y.to(x.dtype)


def pack_int4(
    q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's CPU int4 layout: packed values and [in // group, out, 2] (scale, zero) in
    KERNEL_DTYPE, where it computes w = (q - 8) * scale + zero. The kernel wants out to be
    a multiple of 16: extra rows of zeros pad it, and callers drop their outputs."""
    pad = -q.shape[0] % 16
    q, scales, mins = (F.pad(t, (0, 0, 0, pad)) for t in (q, scales, mins))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
    s = scales.float()
    scale_zeros = torch.stack([s, mins.float() + 8 * s], dim=-1).transpose(0, 1)
    return packed, scale_zeros.contiguous().to(KERNEL_DTYPE)


def int4_grouped(
    x: torch.Tensor, packed: torch.Tensor, scale_zeros: torch.Tensor, group: int
) -> torch.Tensor:
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(KERNEL_DTYPE), packed, group, scale_zeros)
    return y.to(x.dtype)


def tiled(
    x: torch.Tensor, out_features: int, rows: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """x @ W.T where rows(a, b) gives W[a:b] in float32."""
    xf = x.float()
    parts = [
        F.linear(xf, rows(a, min(a + TILE_ROWS, out_features)))
        for a in range(0, out_features, TILE_ROWS)
    ]
    return torch.cat(parts, dim=-1).to(x.dtype)
