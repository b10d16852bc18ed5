"""Triton kernels that merge the transformer's small elementwise steps on CUDA.

Each reproduces the rounding of the plain torch code it replaces (transformer.py, rope.py):
float32 math, cast to the activation dtype where torch casts, so greedy tokens stay put.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kamado.pdl import launch_options, let_next_start, wait_for_inputs


@triton.jit
def _add_rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    let_next_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
    wait_for_inputs(PDL)
    x = tl.load(x_ptr + row * N + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:  # x + residual, rounded like the torch add, is the new residual
        x = (x.to(tl.float32) + tl.load(res_ptr + row * N + offs, mask=mask, other=0.0)).to(x.dtype)
        tl.store(res_out_ptr + row * N + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * normed).to(x.dtype), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of x (+ residual); returns (normed, the sum that is the next residual)."""
    x = x.contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    _add_rms_norm_kernel[(x.numel() // n,)](
        x, residual if residual is not None else x, out, res_out, weight, eps,
        N=n, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=residual is not None,
        num_warps=8 if n >= 4096 else 4, **launch_options(x.device),
    )  # fmt: skip
    return out, res_out


@triton.jit
def _qk_norm_rope_kernel(
    qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, k_cache, v_cache, slot_mapping, eps,
    stride_t, stride_slot,
    NUM_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr, HAS_NORM: tl.constexpr, STORE_KV: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One head of one token, in place: optional RMSNorm over head_dim, then rotate-half.
    STORE_KV: a K head's program also writes the rotated K, and the V head beside it, into
    the cache at the token's slot (none for a negative slot: a padding row)."""
    let_next_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HALF
    offs = tl.arange(0, HALF)
    # Positions, the rope tables, the norm weights and the slots: no kernel writes them.
    pos = tl.load(pos_ptr + t)
    row = pos * HEAD_DIM
    cos1, cos2 = tl.load(cos_ptr + row + offs), tl.load(cos_ptr + row + half + offs)
    sin1, sin2 = tl.load(sin_ptr + row + offs), tl.load(sin_ptr + row + half + offs)
    if HAS_NORM:
        w_ptr = qw_ptr if head < NUM_HEADS else kw_ptr
        w1 = tl.load(w_ptr + offs).to(tl.float32)
        w2 = tl.load(w_ptr + half + offs).to(tl.float32)
    if STORE_KV:
        slot = tl.load(slot_mapping + t).to(tl.int64)
    wait_for_inputs(PDL)
    base = qkv_ptr + t * stride_t + head * HEAD_DIM
    x1 = tl.load(base + offs)
    x2 = tl.load(base + half + offs)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(x1f * x1f, 0) + tl.sum(x2f * x2f, 0)) / HEAD_DIM + eps)
        x1f = (w1 * (x1f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    out1 = (x1f * cos1 + -x2f * sin1).to(dtype)
    out2 = (x2f * cos2 + x1f * sin2).to(dtype)
    tl.store(base + offs, out1)
    tl.store(base + half + offs, out2)
    if STORE_KV:  # noqa: SIM102 (a compile-time branch: `slot` exists only under it)
        if head >= NUM_HEADS and slot >= 0:  # a K head; its V head is KV_HEADS heads on
            k_slot = k_cache + slot * stride_slot + (head - NUM_HEADS) * HEAD_DIM
            tl.store(k_slot + offs, out1)
            tl.store(k_slot + half + offs, out2)
            v_head = base + KV_HEADS * HEAD_DIM
            v_slot = v_cache + slot * stride_slot + (head - NUM_HEADS) * HEAD_DIM
            tl.store(v_slot + offs, tl.load(v_head + offs))
            tl.store(v_slot + half + offs, tl.load(v_head + half + offs))


def qk_norm_rope(
    qkv: torch.Tensor,  # [T, (heads + 2 * kv_heads) * head_dim], q then k then v
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Normalize (qk-norm models) and rotate the q and k heads of qkv in place. With
    `kv_store` (an unquantized layer's K and V caches, [num_slots, kv_heads, head_dim], and
    each token's slot, negative: none), also write the token's K and V there, as store_kv
    would."""
    has_norm = q_norm is not None
    k_cache, v_cache, slots = kv_store or (qkv, qkv, positions)  # unread without kv_store
    _qk_norm_rope_kernel[(qkv.shape[0], num_heads + num_kv_heads)](
        qkv, positions, cos, sin, q_norm if has_norm else cos, k_norm if has_norm else cos,
        k_cache, v_cache, slots, eps, qkv.stride(0), k_cache.stride(0),
        NUM_HEADS=num_heads, KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        HAS_NORM=has_norm, STORE_KV=kv_store is not None, num_warps=1,
        **launch_options(qkv.device),
    )  # fmt: skip
