"""Compressed weights widened to the activation dtype on CUDA, for inputs too wide for the
kernels that read compressed bytes (prefill): cuBLAS then multiplies the widened weight.

One kernel pass reads the compressed bytes and writes each value once, computed in float32
and rounded once. The torch expressions this replaces made several full-size temporaries
(int4: the unpacked nibbles as int32, then bytes, the dtype's values, the scaled and the
shifted ones), about 30 bytes of traffic per weight value against 2.5 here, and a peak
of several times the widened weight's memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16  # weight rows a program widens
BLOCK_INPUTS = 512  # inputs a program widens (int8 and fp8)


@triton.jit
def _widen_scaled_kernel(
    q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on,
    GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out = q * scale for int8 or fp8 q, a scale per GROUP inputs of a row (GROUP = K:
    one a row)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    rows64 = rows.to(tl.int64)[:, None]
    inside = (rows < N)[:, None] & (ks < K)[None, :]
    q = tl.load(q_ptr + rows64 * stride_qn + ks[None, :], mask=inside)
    scale = tl.load(s_ptr + rows64 * stride_sn + (ks // GROUP)[None, :], mask=inside)
    values = q.to(tl.float32) * scale.to(tl.float32)
    out = out_ptr + rows64 * stride_on + ks[None, :]
    tl.store(out, values.to(out_ptr.dtype.element_ty), inside)


@triton.jit
def _widen_int4_kernel(
    w_ptr, sm_ptr, out_ptr, N, stride_wn, stride_sn, stride_on,
    GROUP: tl.constexpr, WORDS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """out = q * scale + min for one group of BLOCK_N rows, from formats.pack_int4's
    words: nibble p of a word is its element 2p, nibble 4 + p its element 2p + 1, and
    element pair p of the group's word j is the group's inputs p * GROUP / 4 + 2j, + 1.
    WORDS is the group's words rounded up to a power of two, a block's length."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    group = tl.program_id(1)
    rows64 = rows.to(tl.int64)[:, None]
    row_ok = (rows < N)[:, None]
    js = tl.arange(0, WORDS)[None, :]
    words = tl.load(
        w_ptr + rows64 * stride_wn + group * (GROUP // 8) + js, mask=row_ok & (js < GROUP // 8)
    )
    inside = row_ok & (tl.arange(0, 2 * WORDS) < GROUP // 4)[None, :]
    scale = tl.load(sm_ptr + rows64 * stride_sn + 2 * group, mask=row_ok).to(tl.float32)
    low = tl.load(sm_ptr + rows64 * stride_sn + 2 * group + 1, mask=row_ok).to(tl.float32)
    out_row = out_ptr + rows64 * stride_on + group * GROUP + tl.arange(0, 2 * WORDS)[None, :]
    for p in tl.static_range(4):
        even = ((words >> (4 * p)) & 15).to(tl.float32) * scale + low
        odd = ((words >> (16 + 4 * p)) & 15).to(tl.float32) * scale + low
        pairs = tl.reshape(tl.join(even, odd), [BLOCK_N, 2 * WORDS])  # inputs in order
        tl.store(out_row + p * (GROUP // 4), pairs.to(out_ptr.dtype.element_ty), mask=inside)


def widen_scaled(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 or fp8 q [out, in] times scales [out, in // group] (group = in: one a row)."""
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype, device=q.device)
    grid = (triton.cdiv(n, BLOCK_ROWS), triton.cdiv(k, BLOCK_INPUTS))
    _widen_scaled_kernel[grid](
        q, scales, out, n, k, q.stride(0), scales.stride(0), out.stride(0),
        GROUP=k // scales.shape[1], BLOCK_N=BLOCK_ROWS, BLOCK_K=BLOCK_INPUTS,
    )  # fmt: skip
    return out


def widen_int4(words: torch.Tensor, scale_mins: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """formats.pack_int4's words [out, in // 8] with scale_mins [out, groups, 2] (each
    group's scale and min) -> q * scale + min [out, in]."""
    n, groups, _ = scale_mins.shape
    k = words.shape[1] * 8
    assert scale_mins.stride()[1:] == (2, 1)
    out = torch.empty(n, k, dtype=dtype, device=words.device)
    _widen_int4_kernel[(triton.cdiv(n, BLOCK_ROWS), groups)](
        words, scale_mins, out, n, words.stride(0), scale_mins.stride(0), out.stride(0),
        GROUP=k // groups, WORDS=triton.next_power_of_2(k // groups // 8), BLOCK_N=BLOCK_ROWS,
    )  # fmt: skip
    return out
