"""Matmuls over compressed weights on CUDA: Triton kernels for decode-sized inputs,
dequantize-then-cuBLAS for everything wider.

Decode reads every weight once per token, so its matmuls are bound by the bytes they read.
- Up to GEMV_MAX_ROWS input rows run a GEMV per row: it reads the int8 / fp8 / packed
  int4 bytes and their scales, widens them in registers and accumulates in float32. int4
  values become floats through their bits (2^23 + q as a float, minus 2^23), not through
  the int-to-float instruction, which Hopper issues at an eighth of the FMA rate.
- fp8 weights of many rows (the output head, gate/up), and fp8 inputs of up to
  DOT_MAX_ROWS rows, go through tensor cores instead: e4m3 widens to fp16 exactly in one
  instruction, and a tile is read once for all rows.
- Wider inputs (prefill, large batches) are compute-bound: the weight is widened to the
  activation dtype once and cuBLAS does the product.
Measured per shape on an H200: `python scripts/gemv_bandwidth.py`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kamado.surgery.formats import unpack_int4

GEMV_MAX_ROWS = 2
DOT_MAX_ROWS = 16  # input rows of the tensor-core fp8 kernel (one MMA tile)
DOT_MIN_OUT = 16384  # output rows from which the tensor-core kernel wins at 1-2 input rows

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in [(8, 512, 4), (16, 1024, 8), (32, 512, 8), (8, 2048, 8), (4, 1024, 4)]
]  # fmt: skip
# Grouped int8 tiles are one group wide: the rows carry the bytes in flight.
_GROUPED_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in [(16, 512, 4), (32, 512, 8), (64, 256, 8), (32, 1024, 8), (64, 512, 8)]
]
_INT4_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "GROUPS_PER_STEP": g}, num_warps=w, num_stages=2)
    for bn, g, w in [(8, 8, 4), (16, 4, 4), (16, 8, 8), (32, 4, 4), (32, 8, 4)]
]
_DOT_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=3)
    for bn, bk in [(64, 256), (64, 512), (32, 256), (32, 512)]
]


@triton.jit
def _store_row(out, b_ptr, out_row_ptr, rows, rows64, N, HAS_BIAS: tl.constexpr):
    """The GEMVs' last step: one input row's float32 outputs [rows], plus the bias, stored
    in the output's dtype (rows past N were computed on a clamped copy, never stored)."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_row_ptr + rows, out.to(out_row_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _rowwise_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = (x[m] @ q[rows].T) * scale[rows]: int8 or fp8 values, a scale per row.

    Rows past N are clamped to the last row (read, never stored) so weight loads need no
    mask when BLOCK_K divides K; pointers advance by BLOCK_K instead of being recomputed."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + m * stride_xm + ks
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs)
        else:
            kmask = k0 + ks < K
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1) * tl.load(s_ptr + rows64).to(tl.float32)
    _store_row(out, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)


@triton.jit
def _grouped_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = sum over groups g of scale[g] * (q_g . x_g), int8 q.

    Each group is its own [rows, group] tile (BLOCK_K // GROUP of them unrolled per loop
    step, so their loads are in flight together), scaled per row and accumulated without
    reducing: the only cross-thread sum is the last one."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    vs = tl.arange(0, GROUP)
    w_base = w_ptr + rows64[:, None] * stride_wn + vs[None, :]
    x_base = x_ptr + m * stride_xm + vs
    s_base = s_ptr + rows64 * stride_sn
    acc = tl.zeros([BLOCK_N, GROUP], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // GROUP):
            k = k0 + j * GROUP
            ok = k < K  # False only in a last, partial step
            q = tl.load(w_base + k, mask=ok, other=0)
            x = tl.load(x_base + k, mask=ok, other=0.0).to(tl.float32)
            scale = tl.load(s_base + k // GROUP, mask=ok, other=0.0).to(tl.float32)
            acc += q.to(tl.float32) * x[None, :] * scale[:, None]
    out = tl.sum(acc, axis=1)
    _store_row(out, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)


@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = sum over groups g of scale[g] * (q_g . x_g) + min[g] * sum(x_g).

    Weights as formats.pack_int4 lays them out: a group is GROUP // 8 int32 words, and
    nibble i of word j is element i * (GROUP // 8) + j, so the inputs each nibble meets are
    one contiguous slice of x. A group's words are one [rows, words] tile; GROUPS_PER_STEP
    of them are unrolled per loop step so their loads are in flight together. The
    minimums' share uses sums of x taken on the way, not a separate pass."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    WORDS: tl.constexpr = GROUP // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    js = tl.arange(0, WORDS)
    w_base = w_ptr + rows64[:, None] * stride_wn + js[None, :]
    x_base = x_ptr + m * stride_xm + js
    s_base = s_ptr + rows64 * stride_sn
    z_base = z_ptr + rows64 * stride_sn
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for g0 in range(0, NUM_GROUPS, GROUPS_PER_STEP):
        for t in tl.static_range(GROUPS_PER_STEP):
            g = g0 + t
            ok = g < NUM_GROUPS  # False only in a last, partial step
            w = tl.load(w_base + g * WORDS, mask=ok, other=0)
            dot = tl.zeros([BLOCK_N, WORDS], tl.float32)
            x_sum = tl.zeros([WORDS], tl.float32)
            for i in tl.static_range(8):
                x = tl.load(x_base + g * GROUP + i * WORDS, mask=ok, other=0.0).to(tl.float32)
                q = (((w >> (4 * i)) & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
                dot += q * x[None, :]
                x_sum += x
            scale = tl.load(s_base + g, mask=ok, other=0.0).to(tl.float32)
            low = tl.load(z_base + g, mask=ok, other=0.0).to(tl.float32)
            acc += dot * scale[:, None] + low[:, None] * x_sum[None, :]
    out = tl.sum(acc, axis=1)
    _store_row(out, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = (x @ q[rows].T) * scale[rows] on tensor cores, in fp16: e4m3 values
    are exact in fp16, x rounds to it (clamped to its range; three more mantissa bits than
    bf16), and products accumulate in float32. Input rows past M are zeros."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + ms[:, None] * stride_xm + ks[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if K % BLOCK_K == 0:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None], other=0.0)
        else:
            kmask = k0 + ks < K
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None] & kmask[None, :], other=0.0)
        x16 = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # fp16's range
        acc = tl.dot(x16, tl.trans(w.to(tl.float16)), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = acc * tl.load(s_ptr + rows64).to(tl.float32)[None, :]
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)[None, :]
    mask = (ms < M)[:, None] & (rows < N)[None, :]
    tl.store(
        out_ptr + ms[:, None] * stride_om + rows[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


# Tuned per weight shape on first use (the engine's warm-up, before graph capture).
_rowwise_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_rowwise_kernel)
_grouped_tuned = triton.autotune(configs=_GROUPED_CONFIGS, key=["N", "K", "GROUP"])(_grouped_kernel)
_int4_tuned = triton.autotune(configs=_INT4_CONFIGS, key=["N", "K", "GROUP"])(_int4_kernel)
_fp8_dot_tuned = triton.autotune(configs=_DOT_CONFIGS, key=["N", "K"])(_fp8_dot_kernel)


def _per_row_grid(n: int, rows: int) -> Callable[[dict], tuple[int, int]]:
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), rows)


def _bias_arg(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return bias if bias is not None else x  # never read without HAS_BIAS


def _gemv(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 or fp8 rows, a scale per row or per group."""
    x = x.contiguous()
    n, k = q.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = _per_row_grid(n, x.shape[0])
    if scales.shape[1] == 1:
        _rowwise_tuned[grid](
            x, q, scales, _bias_arg(x, bias), out, n, x.stride(0), q.stride(0), out.stride(0),
            K=k, HAS_BIAS=bias is not None,
        )  # fmt: skip
        return out
    _grouped_tuned[grid](
        x, q, scales, _bias_arg(x, bias), out, n, x.stride(0), q.stride(0), scales.stride(0),
        out.stride(0), K=k, GROUP=k // scales.shape[1], HAS_BIAS=bias is not None,
    )  # fmt: skip
    return out


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, q, scales, bias)
    n, k = q.shape
    w = (q.view(n, scales.shape[1], -1).to(x.dtype) * scales.to(x.dtype)[..., None]).view(n, k)
    return F.linear(x, w, bias)


def int4_matmul(
    x: torch.Tensor,
    words: torch.Tensor,  # formats.pack_int4's layout
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    n, groups = scales.shape
    k = words.shape[1] * 8
    if x.shape[0] <= GEMV_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
        _int4_tuned[_per_row_grid(n, x.shape[0])](
            x, words, scales, mins, _bias_arg(x, bias), out, n, x.stride(0), words.stride(0),
            scales.stride(0), out.stride(0), K=k, GROUP=k // groups, HAS_BIAS=bias is not None,
        )  # fmt: skip
        return out
    q = unpack_int4(words, k // groups).view(n, groups, -1).to(x.dtype)
    w = q * scales.to(x.dtype)[..., None] + mins.to(x.dtype)[..., None]
    return F.linear(x, w.view(n, k), bias)


def fp8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    n, k = q.shape
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS and n < DOT_MIN_OUT:
        return _gemv(x, q, scales, bias)
    if rows <= DOT_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _fp8_dot_tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)](
            x, q, scales, _bias_arg(x, bias), out, rows, n, x.stride(0), q.stride(0),
            out.stride(0), K=k, HAS_BIAS=bias is not None, BLOCK_M=DOT_MAX_ROWS,
        )  # fmt: skip
        return out
    return F.linear(x, q.to(x.dtype) * scales.to(x.dtype), bias)
