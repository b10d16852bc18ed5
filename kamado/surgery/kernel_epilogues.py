"""The last steps shared by the Triton matmul kernels (kamado.surgery.triton_matmul,
int4_gemv, int4_tensor_cores): storing a GEMV's row or a tensor-core tile, adding up
split-K partial sums, and the SiLU-gated product that ends an MLP's gate/up matmul."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kamado.pdl import launch_options, let_next_start, wait_for_inputs


@triton.jit
def store_row(out, b_ptr, out_row_ptr, rows, rows64, N, HAS_BIAS: tl.constexpr):
    """The GEMVs' last step: one input row's float32 outputs [rows], plus the bias, stored
    in the output's dtype (rows past N were computed on a clamped copy, never stored)."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_row_ptr + rows, out.to(out_row_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def silu_times(gate, up):
    """silu(gate) * up in the activation dtype of `gate` and `up`, rounded where torch's
    F.silu(gate) * up rounds: float32 math, the SiLU cast to the dtype before the product."""
    gf = gate.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


@triton.jit
def store_gated_row(
    gate, up, b_ptr, out_row_ptr, rows, rows64, N, HAS_BIAS: tl.constexpr
):  # fmt: skip
    """A gated GEMV's last step: one input row's float32 gate and up outputs [rows] (up's
    bias N rows after gate's), each rounded to the output's dtype as an unfused matmul
    would store it, then silu(gate) * up stored."""
    if HAS_BIAS:
        gate += tl.load(b_ptr + rows64).to(tl.float32)
        up += tl.load(b_ptr + N + rows64).to(tl.float32)
    dtype = out_row_ptr.dtype.element_ty
    tl.store(out_row_ptr + rows, silu_times(gate.to(dtype), up.to(dtype)), mask=rows < N)


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


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    let_next_start(PDL)
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < INTER
    gate = tl.load(gu_ptr + row * 2 * INTER + offs, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * 2 * INTER + INTER + offs, mask=mask, other=0.0)
    tl.store(out_ptr + row * INTER + offs, silu_times(gate, up), mask=mask)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2 * inter] (gate then up) -> silu(gate) * up, [T, inter]."""
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(gate_up.shape[0], triton.cdiv(inter, block))](
        gate_up, out, INTER=inter, BLOCK=block, **launch_options(gate_up.device)
    )
    return out
