"""Matmuls over compressed weights on CUDA: a Triton GEMV for decode, dequantize-then-cuBLAS
for everything wider.

Decode of one token is a matrix-vector product per layer, bound by the bytes of the weight
it reads; the kernel reads the int8 / packed int4 / fp8 bytes and their scales once, widens
in registers and accumulates in float32. Up to GEMV_MAX_ROWS input rows each run the GEMV
(the weight is read once per row: at two rows no more bytes than bf16). Wider inputs
(prefill, large decode batches) are compute-bound: the weight is widened to the activation
dtype once and cuBLAS does the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kamado.surgery.formats import unpack_int4

GEMV_MAX_ROWS = 2

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in [(8, 512, 4), (16, 1024, 8), (32, 512, 8), (8, 2048, 8), (4, 1024, 4)]
]
# Grouped tiles are one group wide: the rows carry the bytes in flight.
_GROUPED_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in [(16, 512, 4), (32, 512, 8), (64, 256, 8), (32, 1024, 8), (64, 512, 8)]
]


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
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _grouped_kernel(
    x_ptr, xsum_ptr, w_ptr, s_ptr, z_ptr, b_ptr, out_ptr, N,
    stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, INT4: tl.constexpr, HAS_MIN: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = sum over groups g of scale[g] * (q_g . x_g) + min[g] * xsum[m, g].

    Each group is its own [rows, group] tile (BLOCK_K // GROUP of them unrolled per loop
    step, so their loads are in flight together), scaled per row and accumulated without
    reducing: the only cross-thread sum is the last one. The per-group sums of x (for the
    minimums) come precomputed. Packed int4 bytes are read once each: the low nibble pairs
    with the even input, the high nibble with the odd one."""
    m = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    PER_BYTE: tl.constexpr = 2 if INT4 else 1
    VALS: tl.constexpr = GROUP // PER_BYTE  # stored elements of one group
    vs = tl.arange(0, VALS)
    w_base = w_ptr + rows64[:, None] * stride_wn + vs[None, :]
    x_base = x_ptr + m * stride_xm + vs * PER_BYTE
    s_base = s_ptr + rows64 * stride_sn
    z_base = z_ptr + rows64 * stride_sn
    acc = tl.zeros([BLOCK_N, VALS], tl.float32)
    acc_min = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for j in tl.static_range(BLOCK_K // GROUP):
            k = k0 + j * GROUP
            ok = k < K  # False only in a last, partial step
            q = tl.load(w_base + k // PER_BYTE, mask=ok, other=0)
            x = tl.load(x_base + k, mask=ok, other=0.0).to(tl.float32)
            if INT4:
                x_odd = tl.load(x_base + k + 1, mask=ok, other=0.0).to(tl.float32)
                t = (q & 15).to(tl.float32) * x[None, :] + (q >> 4).to(tl.float32) * x_odd[None, :]
            else:
                t = q.to(tl.float32) * x[None, :]
            scale = tl.load(s_base + k // GROUP, mask=ok, other=0.0).to(tl.float32)
            acc += t * scale[:, None]
            if HAS_MIN:
                x_sum = tl.load(xsum_ptr + m * (K // GROUP) + k // GROUP, mask=ok, other=0.0)
                acc_min += x_sum * tl.load(z_base + k // GROUP, mask=ok, other=0.0).to(tl.float32)
    out = tl.sum(acc, axis=1) + acc_min
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_ptr + m * stride_om + rows, out.to(out_ptr.dtype.element_ty), mask=rows < N)


# Tuned per weight shape on first use (the engine's warm-up, before graph capture).
_rowwise_tuned = triton.autotune(configs=_CONFIGS, key=["N", "K"])(_rowwise_kernel)
_grouped_tuned = triton.autotune(configs=_GROUPED_CONFIGS, key=["N", "K", "GROUP"])(_grouped_kernel)


def _gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    bias: torch.Tensor | None,
    in_features: int,
    int4: bool,
    block: tuple[int, int] | None = None,  # (BLOCK_N, BLOCK_K) instead of tuning
) -> torch.Tensor:
    x = x.contiguous()
    n = w.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    bias_arg = bias if bias is not None else x
    fixed = {} if block is None else dict(BLOCK_N=block[0], BLOCK_K=block[1])

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(n, meta["BLOCK_N"]), x.shape[0]

    if scales.shape[1] == 1:
        kernel = _rowwise_tuned if block is None else _rowwise_kernel
        kernel[grid](
            x, w, scales, bias_arg, out, n, x.stride(0), w.stride(0), out.stride(0),
            K=in_features, HAS_BIAS=bias is not None, **fixed,
        )  # fmt: skip
        return out
    group = in_features // scales.shape[1]
    # Per-group sums of x, for the minimums' share: [M, groups] float32.
    x_sums = x.float().view(x.shape[0], -1, group).sum(-1) if mins is not None else scales
    kernel = _grouped_tuned if block is None else _grouped_kernel
    kernel[grid](
        x, x_sums, w, scales, mins if mins is not None else scales, bias_arg, out,
        n, x.stride(0), w.stride(0), scales.stride(0), out.stride(0),
        K=in_features, GROUP=group, INT4=int4,
        HAS_MIN=mins is not None, HAS_BIAS=bias is not None, **fixed,
    )  # fmt: skip
    return out


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, q, scales, None, bias, q.shape[1], int4=False)
    n, k = q.shape
    w = (q.view(n, scales.shape[1], -1).to(x.dtype) * scales.to(x.dtype)[..., None]).view(n, k)
    return F.linear(x, w, bias)


def int4_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    k = packed.shape[1] * 2
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, packed, scales, mins, bias, k, int4=True)
    n, groups = scales.shape
    q = unpack_int4(packed).view(n, groups, -1).to(x.dtype)
    w = q * scales.to(x.dtype)[..., None] + mins.to(x.dtype)[..., None]
    return F.linear(x, w.view(n, k), bias)


def fp8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, q, scales, None, bias, q.shape[1], int4=False)
    return F.linear(x, q.to(x.dtype) * scales.to(x.dtype), bias)
