"""The last steps shared by the Triton matmul kernels (kamado.surgery.triton_matmul,
int4_gemv, int4_tensor_cores): storing a GEMV's row or a tensor-core tile, and adding up
split-K partial sums."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def store_row(out, b_ptr, out_row_ptr, rows, rows64, N, HAS_BIAS: tl.constexpr):
    """The GEMVs' last step: one input row's float32 outputs [rows], plus the bias, stored
    in the output's dtype (rows past N were computed on a clamped copy, never stored)."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_row_ptr + rows, out.to(out_row_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def sum_splits(
    acc, elems, partial_ptr, arrived_ptr, tile, split,
    TILE_ELEMS: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """Split-K: SPLIT_K programs each computed a float32 partial `acc` of one output tile
    (`elems`: each value's index in the tile). Each writes its partial to partial_ptr; the
    last to arrive (an acq_rel count per tile) adds them up in split order, so every run
    gives the same bits, and resets the count for the next call.
    Returns (the sum, whether this program is the one to store it)."""
    tile_partials = partial_ptr + tile * (SPLIT_K * TILE_ELEMS) + elems
    tl.store(tile_partials + split * TILE_ELEMS, acc)
    tl.debug_barrier()  # every thread's partial is written before the release below
    last = tl.atomic_add(arrived_ptr + tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
    if last:
        acc = tl.load(tile_partials, cache_modifier=".cg")
        for other in tl.static_range(1, SPLIT_K):
            acc += tl.load(tile_partials + other * TILE_ELEMS, cache_modifier=".cg")
        tl.store(arrived_ptr + tile, 0)  # ready for the next call
    return acc, last


@triton.jit
def store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """The tensor-core kernels' last step: float32 [BLOCK_M, BLOCK_N] plus the bias, stored
    in the output's dtype for the real input rows and output rows."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows64).to(tl.float32)[None, :]
    mask = (ms < M)[:, None] & (rows < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], out, mask=mask)


@triton.jit
def tile_sum(
    acc, ms, partial_ptr, arrived_ptr, tile, split, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr,
):  # fmt: skip
    """A tensor-core kernel's float32 products as [BLOCK_M, BLOCK_N] (transposed back
    where SWAP put the weights on the left of the product), added over its SPLIT_K
    programs (sum_splits). Returns (the tile, whether this program is the one to store
    it)."""
    if SWAP:
        acc = tl.trans(acc)
    last = True
    if SPLIT_K > 1:
        elems = ms[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc, last = sum_splits(
            acc, elems, partial_ptr, arrived_ptr, tile, split, BLOCK_M * BLOCK_N, SPLIT_K
        )
    return acc, last
