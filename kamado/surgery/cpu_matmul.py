"""Matmuls over compressed weights on CPU.

Per-row int8 and grouped int4 use torch's own packed-weight kernels (the ones gpt-fast
uses), which read the compressed bytes directly. Those are built for bf16 activations,
so they always run in bf16, scales included, and cast the result back (two threads, a
9728x896 matmul of one input row: 0.25 ms for int8, 0.24 for int4, against 1.31 for bf16
F.linear; bench/results/2026-12-06-cpu-matmul-speed.txt). torch has no kernel for int8
with a scale per group (GGUF's Q8_0 and Q5_0), so those are split into two int4 layers its
int4 kernel reads, low and high nibbles; the two products add up to the whole exactly,
before bf16 rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

KERNEL_DTYPE = torch.bfloat16  # what torch's packed-weight CPU kernels are fast in
INT4_KERNEL_GROUPS = (32, 64, 128, 256)  # the group sizes torch's CPU int4 kernel takes
# Per-row int8 from this many input rows widens its weight to bf16 tiles for oneDNN:
# there torch's int8 kernel is 1.6-2.4x slower than widening (64-256 rows, same file).
WIDEN_FROM_ROWS = 64
TILE_ROWS = 1024


def int8_rowwise(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, in] @ (q * scales).T for per-row scales [out] in KERNEL_DTYPE: torch's int8
    kernel for a few input rows (decode), int8_widened for a prompt's chunk."""
    xk = x.to(KERNEL_DTYPE)
    if x.shape[0] < WIDEN_FROM_ROWS:
        return torch.ops.aten._weight_int8pack_mm(xk, q, scales).to(x.dtype)
    return int8_widened(xk, q, scales).to(x.dtype)


def int8_widened(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x @ (q * scales).T in KERNEL_DTYPE with the weight widened TILE_ROWS rows at a time
    for oneDNN's matmul, so no whole widened copy is ever made."""
    tiles = [
        F.linear(x, q[a : a + TILE_ROWS].to(KERNEL_DTYPE) * scales[a : a + TILE_ROWS, None])
        for a in range(0, q.shape[0], TILE_ROWS)
    ]
    return torch.cat(tiles, dim=-1)


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


Int4Pack = tuple[torch.Tensor, torch.Tensor]  # pack_int4's (packed values, scale_zeros)


def pack_int8_groups(q: torch.Tensor, scales: torch.Tensor) -> tuple[Int4Pack, Int4Pack]:
    """int8 q [out, in] with scales [out, in // group] as two int4 layers whose weights
    add up to q * scale: q = low + 16 * high, low = q & 15 in 0..15 and high = q >> 4 in
    -8..7 (stored as high + 8, whose min -128 * scale puts the 8 back)."""
    group = q.shape[1] // scales.shape[1]
    if group not in INT4_KERNEL_GROUPS:
        raise ValueError(f"grouped int8 on CPU needs groups of {INT4_KERNEL_GROUPS}, not {group}")
    s = scales.float()
    low = (q & 15).to(torch.uint8)
    high = ((q >> 4) + 8).to(torch.uint8)
    return pack_int4(low, s, torch.zeros_like(s)), pack_int4(high, 16 * s, -128 * s)


def int8_grouped(x: torch.Tensor, packs: tuple[Int4Pack, Int4Pack], group: int) -> torch.Tensor:
    """x [M, in] @ (q * scales).T for pack_int8_groups' two layers."""
    (low, low_scale_zeros), (high, high_scale_zeros) = packs
    y = int4_grouped(x, low, low_scale_zeros, group).float()
    return (y + int4_grouped(x, high, high_scale_zeros, group).float()).to(x.dtype)
