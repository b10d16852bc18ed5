"""Triton kernels over the paged KV cache: write new K/V, decode attention, extend attention.

The cache is one [num_slots, kv_heads, head_dim] tensor per layer and per K/V; a sequence's
token at position p lives in slot block_table[p // block_size] * block_size + p % block_size.
Softmax runs in float32 with exp2 (the scale folded with log2(e)); all kernels take a
sliding window (0 = none): a query at position p sees keys (p - window, p].

A quantized cache (kv/quant.py: int8 or fp8 codes, a float32 scale per slot and kv head in
[num_slots, kv_heads] tensors) is read as codes, never dequantized in memory: the dot
products run on the codes (in fp16), K's scales multiply the scores and V's scales the
probabilities. A static format's scale tensors have stride 0 over the slots: every slot
reads its layer's scales, and the store kernel quantizes with them and writes none.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kamado.pdl import launch_options, let_next_start, wait_for_inputs

LOG2E = 1.4426950408889634
# Most slices one context's keys are split into. The split count is a plain argument, not a
# compile-time constant, so a new count needs no new compile mid-run (each took 0.6-2.5 s).
MAX_SPLITS = 64
MIN_SCALE = tl.constexpr(1.1754943508222875e-38)  # as kv/quant.py: smallest normal float32


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache, v_cache, slot_mapping,
    stride_k, stride_v, stride_slot,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    let_next_start(PDL)
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch
        return
    offs = tl.arange(0, ROW_PAD)
    mask = offs < ROW
    k = tl.load(k_ptr + t * stride_k + offs, mask=mask)
    v = tl.load(v_ptr + t * stride_v + offs, mask=mask)
    tl.store(k_cache + slot * stride_slot + offs, k, mask=mask)
    tl.store(v_cache + slot * stride_slot + offs, v, mask=mask)


@triton.jit
def _quantize_store(
    src, dst, scale_at, offs, h, hmask,
    QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr,
):  # fmt: skip
    """One token's [heads, head_dim] as codes plus a scale per head (STATIC: codes with the
    scales at scale_at, none written); rounding as in kv/quant.py (IEEE division, to nearest
    even), so both backends write the same bytes."""
    x = tl.load(src + offs, mask=hmask[:, None], other=0.0).to(tl.float32)
    if STATIC:
        scale = tl.load(scale_at + h, mask=hmask, other=1.0)
    else:
        amax = tl.max(tl.abs(x), 1)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32))
        scale = tl.maximum(scale, MIN_SCALE)
    y = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    codes = libdevice.rint(y).to(tl.int8) if INT8 else y.to(dst.dtype.element_ty)
    tl.store(dst + offs, codes, mask=hmask[:, None])
    if not STATIC:
        tl.store(scale_at + h, scale, mask=hmask)


@triton.jit
def _store_kv_quant_kernel(
    k_ptr, v_ptr, k_cache, v_cache, k_scale, v_scale, slot_mapping,
    stride_k, stride_v, stride_slot, stride_sslot,
    KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    QMAX: tl.constexpr, INT8: tl.constexpr, STATIC: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    let_next_start(PDL)
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:  # a padding row of a captured batch
        return
    h = tl.arange(0, HEADS_PAD)
    hmask = h < KV_HEADS
    offs = h[:, None] * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
    _quantize_store(
        k_ptr + t * stride_k, k_cache + slot * stride_slot, k_scale + slot * stride_sslot,
        offs, h, hmask, QMAX, INT8, STATIC,
    )  # fmt: skip
    _quantize_store(
        v_ptr + t * stride_v, v_cache + slot * stride_slot, v_scale + slot * stride_sslot,
        offs, h, hmask, QMAX, INT8, STATIC,
    )  # fmt: skip


def _dense_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, kv_heads, head_dim] with each token's values side by side (a view of qkv is)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    qmax: float | None = None,
) -> None:  # fmt: skip
    """k, v: [T, kv_heads, head_dim] into the cache at slot_mapping[T] (negative: skipped);
    with `scales` (K's and V's [num_slots, kv_heads] float32), quantized to codes <= qmax:
    with a scale per slot, written there, or with a static format's (stride 0 over slots)."""
    k, v = _dense_rows(k), _dense_rows(v)
    if scales is not None:
        assert qmax is not None
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        _store_kv_quant_kernel[(k.shape[0],)](
            k, v, k_cache, v_cache, scales[0], scales[1], slot_mapping,
            k.stride(0), v.stride(0), k_cache.stride(0), scales[0].stride(0),
            KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HEAD_DIM=head_dim, QMAX=qmax, INT8=k_cache.dtype == torch.int8,
            STATIC=scales[0].stride(0) == 0, **launch_options(k.device),
        )  # fmt: skip
        return
    k, v = k.reshape(k.shape[0], -1), v.reshape(v.shape[0], -1)
    row = k.shape[1]
    _store_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), v.stride(0), k_cache.stride(0),
        ROW=row, ROW_PAD=triton.next_power_of_2(row), **launch_options(k.device),
    )  # fmt: skip


@triton.jit
def _fp16_for_codes(q):
    """Queries for dots with int8/fp8 codes, which widen to fp16 exactly in one instruction
    (to bf16 in several), so those dots run in fp16; clamped to its range. Probabilities
    times V's scales go to fp16 too: where they are too small for its precision, they are
    too small to move the output."""
    return tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)


# A word of four int8 codes -> four fp16, exactly: each byte with its sign bit flipped
# (x + 128) under the exponent byte 0x64 is the fp16 1024 + x + 128; less 1152 is x.
_INT8_WORD_AS_FP16 = tl.constexpr(
    "{ .reg .b32 u, m; xor.b32 u, $2, 0x80808080;"
    " prmt.b32 $0, u, 0x64646464, 0x5140; prmt.b32 $1, u, 0x64646464, 0x7362;"
    " mov.b32 m, 0x64806480; sub.f16x2 $0, $0, m; sub.f16x2 $1, $1, m; }"
)


@triton.jit
def _int8_words_as_fp16(words):
    """int32 words [N, W] of four int8 codes each -> fp16 [N, 4W], exactly.

    Loaded as bytes, int8 codes are widened where the dot with V reads them, transposed:
    one shared-memory byte load and one slow I2F a code. Loaded as words, they widen four
    at a time and reach the tensor cores as fp16, as a bf16 tile does. (e4m3 codes widen
    two to an instruction, and as bytes they are faster: measured.) The asm sees each word
    four times (the joins) and uses one copy."""
    n: tl.constexpr = words.shape[0]
    w: tl.constexpr = words.shape[1]
    copies = tl.join(tl.join(words, words), tl.join(words, words))
    values = tl.inline_asm_elementwise(
        _INT8_WORD_AS_FP16, "=r,=r,r,r,r,r", [copies], dtype=tl.float16, is_pure=True, pack=4
    )
    return tl.reshape(values, [n, 4 * w])


@triton.jit
def _as_dot_operand(x, q, INT8_WORDS: tl.constexpr):
    """A tile of the cache as loaded (INT8_WORDS: int32 words of four codes) in q's dtype."""
    return _int8_words_as_fp16(x) if INT8_WORDS else x.to(q.dtype)


@triton.jit
def _decode_tile_at(
    block_tables, b, stride_bt, n0, hi, kvh, stride_slot, stride_kvh,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ROW: tl.constexpr,
):  # fmt: skip
    """The positions [n0, n0 + BLOCK_N) of row b's context: which are below hi, their cache
    slots, and where kv head kvh's ROW elements of each lie in the cache."""
    pos = n0 + tl.arange(0, BLOCK_N)
    pmask = pos < hi
    blk = tl.load(block_tables + b * stride_bt + pos // BLOCK_SIZE, mask=pmask, other=0)
    slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + tl.arange(0, ROW)[None, :]
    return pos, pmask, slot, kv_off


@triton.jit
def _decode_tile(
    q, k, v, slot, pmask, acc, m_i, l_i, k_scale, v_scale, stride_sslot, kvh, qk_scale,
    SCALED: tl.constexpr,
):  # fmt: skip
    """Online softmax of the group's queries over one tile of keys k and values v."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if SCALED:
        s *= tl.load(k_scale + slot * stride_sslot + kvh, mask=pmask, other=0.0)[None, :]
    s = tl.where(pmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p *= tl.load(v_scale + slot * stride_sslot + kvh, mask=pmask, other=0.0)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit
def _decode_first_tile(
    q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, b, kvh, ctx, lo, hi,
    stride_qt, stride_qh, stride_slot, stride_kvh, stride_sslot, stride_bt, qk_scale,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, SCALED: tl.constexpr,
    INT8_WORDS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The group's queries and its online softmax after the slice's first TILE keys.

    That tile loads before the wait for the kernels before (kamado.pdl), all but the token
    at ctx - 1, which this step writes: the rest of the cache, the block tables and the
    lengths were written before the step began."""
    ROW: tl.constexpr = HEAD_DIM // 4 if INT8_WORDS else HEAD_DIM
    pos, pmask, slot, kv_off = _decode_tile_at(
        block_tables, b, stride_bt, lo, hi, kvh, stride_slot, stride_kvh, BLOCK_SIZE, TILE,
        ROW,
    )  # fmt: skip
    old = (pmask & (pos < ctx - 1))[:, None]
    k_first = tl.load(k_cache + kv_off, mask=old, other=0.0)
    v_first = tl.load(v_cache + kv_off, mask=old, other=0.0)
    wait_for_inputs(PDL)
    new = (pmask & (pos == ctx - 1))[:, None]
    k_first = tl.where(new, tl.load(k_cache + kv_off, mask=new, other=0.0), k_first)
    v_first = tl.where(new, tl.load(v_cache + kv_off, mask=new, other=0.0), v_first)

    g = tl.arange(0, GROUP_PAD)
    heads = kvh * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=(g < GROUP)[:, None]
    )
    if SCALED:
        q = _fp16_for_codes(q)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if lo < hi:
        acc, m_i, l_i = _decode_tile(
            q, _as_dot_operand(k_first, q, INT8_WORDS), _as_dot_operand(v_first, q, INT8_WORDS),
            slot, pmask, acc, m_i, l_i, k_scale, v_scale, stride_sslot, kvh, qk_scale, SCALED,
        )  # fmt: skip
    return q, acc, m_i, l_i


@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, mid_out, mid_lse,
    stride_qt, stride_qh, stride_slot, stride_kvh, stride_sslot, stride_bt,
    stride_mb, stride_mh, stride_ms,
    qk_scale, window, num_splits,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SHORT_N: tl.constexpr,
    SPLIT: tl.constexpr, SCALED: tl.constexpr, INT8_WORDS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (sequence, kv head, split): the group's queries against a slice of the context.
    An int8 cache comes as int32 words of four codes (INT8_WORDS; strides in words).

    A slice of at most SHORT_N keys (a short context spread over the splits) is one tile of
    SHORT_N: a BLOCK_N tile would mask most of its keys and still pay for all of them."""
    let_next_start(PDL)
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(context_lens + b)
    start = 0
    if window > 0:
        start = tl.maximum(ctx - window, 0)
    # Slices are multiples of the cache block, not of the tile, so a short context still
    # spreads over the splits (a tile's positions past its slice are masked).
    per_split = tl.cdiv(tl.cdiv(ctx - start, num_splits), BLOCK_SIZE) * BLOCK_SIZE
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, ctx)
    # A tile's width is a compile-time shape, so each width is a call of its own.
    if per_split <= SHORT_N:
        q, acc, m_i, l_i = _decode_first_tile(
            q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, b, kvh, ctx, lo, hi,
            stride_qt, stride_qh, stride_slot, stride_kvh, stride_sslot, stride_bt, qk_scale,
            GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, SHORT_N, SCALED, INT8_WORDS, PDL,
        )  # fmt: skip
    else:
        q, acc, m_i, l_i = _decode_first_tile(
            q_ptr, k_cache, v_cache, k_scale, v_scale, block_tables, b, kvh, ctx, lo, hi,
            stride_qt, stride_qh, stride_slot, stride_kvh, stride_sslot, stride_bt, qk_scale,
            GROUP, GROUP_PAD, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SCALED, INT8_WORDS, PDL,
        )  # fmt: skip
        ROW: tl.constexpr = HEAD_DIM // 4 if INT8_WORDS else HEAD_DIM
        for n0 in range(lo + BLOCK_N, hi, BLOCK_N):
            pos, pmask, slot, kv_off = _decode_tile_at(
                block_tables, b, stride_bt, n0, hi, kvh, stride_slot, stride_kvh, BLOCK_SIZE,
                BLOCK_N, ROW,
            )  # fmt: skip
            k = tl.load(k_cache + kv_off, mask=pmask[:, None], other=0.0)
            v = tl.load(v_cache + kv_off, mask=pmask[:, None], other=0.0)
            k, v = _as_dot_operand(k, q, INT8_WORDS), _as_dot_operand(v, q, INT8_WORDS)
            acc, m_i, l_i = _decode_tile(
                q, k, v, slot, pmask, acc, m_i, l_i, k_scale, v_scale, stride_sslot, kvh,
                qk_scale, SCALED,
            )  # fmt: skip
    g = tl.arange(0, GROUP_PAD)
    out_off = b * stride_mb + (kvh * GROUP + g) * stride_mh + split * stride_ms
    _store_partial(mid_out, mid_lse, out_off, acc, m_i, l_i, g < GROUP, HEAD_DIM, SPLIT)


@triton.jit
def _store_partial(
    mid_out, mid_lse, off, acc, m_i, l_i, row_mask,
    HEAD_DIM: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    """A split's normalized output rows at `off` in mid_out, and their log-sum-exps (base 2)
    at off / HEAD_DIM in mid_lse. Not SPLIT (one split): mid_out is the output itself (the
    store casts to its dtype), and no merge follows."""
    d = tl.arange(0, HEAD_DIM)
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(mid_out + off[:, None] + d[None, :], out, mask=row_mask[:, None])
    if SPLIT:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(mid_lse + off // HEAD_DIM, lse, mask=row_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    mid_out, mid_lse, out_ptr,
    stride_mb, stride_mh, stride_ms, stride_ot, stride_oh, num_splits,
    HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Merge the splits of one (row, head) by their log-sum-exps."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    smask = s < num_splits
    d = tl.arange(0, HEAD_DIM)
    base = b * stride_mb + h * stride_mh + s * stride_ms
    lse = tl.load(mid_lse + base // HEAD_DIM, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.where(lse > float("-inf"), tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    parts = tl.load(mid_out + base[:, None] + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def decode_attention(
    q: torch.Tensor,  # [B, heads, head_dim], one query per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32; 0 for a padding row (output 0)
    block_size: int,
    num_splits: int,  # at most MAX_SPLITS; fixed per captured batch size
    window: int = 0,
    block_n: int = 128,  # measured: bf16 and fp8 as bytes, int8 as words (README)
    short_n: int = 64,  # the tile of a split's slice of at most this many keys (measured)
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # of a quantized cache
) -> torch.Tensor:
    """Split-K paged decode: each split attends to a slice, then a reduce merges them."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    mid_out, mid_lse = split_buffers(out, num_splits)
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread when unscaled
    int8_words = k_cache.dtype == torch.int8
    if int8_words:
        k_cache, v_cache = k_cache.view(torch.int32), v_cache.view(torch.int32)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, context_lens, mid_out, mid_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_scale.stride(0),
        block_tables.stride(0), mid_out.stride(0), mid_out.stride(1), mid_out.stride(2),
        head_dim**-0.5 * LOG2E, window, num_splits,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SHORT_N=short_n, SPLIT=num_splits > 1,
        SCALED=scales is not None, INT8_WORDS=int8_words, num_warps=4, num_stages=2,
        **launch_options(q.device),
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(mid_out, mid_lse, out)
    return out


def split_buffers(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the kernels write each split's partial output and log-sum-exp for `out`
    ([rows, heads, head_dim]); with one split, `out` itself (no merge follows)."""
    rows, num_heads, head_dim = out.shape
    if num_splits == 1:
        mid = out.view(rows, num_heads, 1, head_dim)
        return mid, mid
    # head_dim floats per split, and one lse each at the same flat index / head_dim.
    mid_out = torch.empty(
        rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device
    )
    mid_lse = torch.empty(rows, num_heads, num_splits, dtype=torch.float32, device=out.device)
    return mid_out, mid_lse


def merge_splits(mid_out: torch.Tensor, mid_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Write out[row, head] from the partial outputs of its splits, weighted by log-sum-exp."""
    rows, num_heads, num_splits, head_dim = mid_out.shape
    _merge_splits_kernel[(rows, num_heads)](
        mid_out, mid_lse, out,
        mid_out.stride(0), mid_out.stride(1), mid_out.stride(2), out.stride(0), out.stride(1),
        num_splits, HEAD_DIM=head_dim, SPLITS_PAD=MAX_SPLITS, **launch_options(out.device),
    )  # fmt: skip


@triton.jit
def _extend_tile(
    acc, m_i, l_i, q, q_pos, n0, hi, k_cache, v_cache, k_scale, v_scale, bt_row, kvh,
    stride_slot, stride_kvh, stride_sslot, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """Online softmax over keys [n0, n0 + BLOCK_N); MASKED applies causality and window."""
    d = tl.arange(0, HEAD_DIM)
    pos = n0 + tl.arange(0, BLOCK_N)
    if MASKED:
        pmask = pos < hi
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=pmask, other=0)
    else:
        blk = tl.load(bt_row + pos // BLOCK_SIZE)
    slot = blk.to(tl.int64) * BLOCK_SIZE + pos % BLOCK_SIZE
    kv_off = slot[:, None] * stride_slot + kvh * stride_kvh + d[None, :]
    s_off = slot * stride_sslot + kvh
    if MASKED:
        k = tl.load(k_cache + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        v = tl.load(v_cache + kv_off, mask=pmask[:, None], other=0.0).to(q.dtype)
        if SCALED:
            k_scales = tl.load(k_scale + s_off, mask=pmask, other=0.0)
            v_scales = tl.load(v_scale + s_off, mask=pmask, other=0.0)
    else:
        k = tl.load(k_cache + kv_off).to(q.dtype)
        v = tl.load(v_cache + kv_off).to(q.dtype)
        if SCALED:
            k_scales = tl.load(k_scale + s_off)
            v_scales = tl.load(v_scale + s_off)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if SCALED:
        s *= k_scales[None, :]
    if MASKED:
        visible = pmask[None, :] & (pos[None, :] <= q_pos[:, None])
        if window > 0:
            visible &= pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 so exp2 gives 0, not NaN.
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if SCALED:
        p *= v_scales[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i


@triton.jit(do_not_specialize=["num_splits"])
def _extend_kernel(
    q_ptr, k_cache, v_cache, k_scale, v_scale, mid_out, mid_lse, block_tables, query_start,
    query_lens, context_lens, stride_qt, stride_qh, stride_mb, stride_mh, stride_ms,
    stride_slot, stride_kvh, stride_sslot, stride_bt, qk_scale, window,
    num_splits,
    GROUP: tl.constexpr, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, SCALED: tl.constexpr,
):  # fmt: skip
    """One (heads and split, query tile, sequence): queries at the end of their context,
    causal. A tile's rows are HEADS heads (of one GQA group) of each of its queries, side
    by side: with a whole group (a short chunk), each key and value loaded serves every
    head that reads it, where a head a program would load them once for each.

    Keys every row of the tile may see run unmasked; the diagonal (and any window) masked.
    With splits, each program attends to one slice of the tile's keys and writes a partial
    output and its log-sum-exp for merge_splits to combine.
    """
    QUERIES = BLOCK_M // HEADS  # queries per tile
    head_sets = tl.num_programs(0) // num_splits
    h0 = tl.program_id(0) % head_sets * HEADS
    split = tl.program_id(0) // head_sets
    tile = tl.program_id(1)
    seq = tl.program_id(2)
    kvh = h0 // GROUP
    q_len = tl.load(query_lens + seq)
    if tile * QUERIES >= q_len:
        return
    q0 = tl.load(query_start + seq)
    ctx = tl.load(context_lens + seq)
    r = tl.arange(0, BLOCK_M)
    h = h0 + r % HEADS
    offs_m = tile * QUERIES + r // HEADS
    # Where HEADS does not divide BLOCK_M, the last rows would repeat the next tile's query.
    mmask = (offs_m < q_len) & (r < QUERIES * HEADS)
    first = ctx - q_len + tile * QUERIES  # position of the tile's first query
    q_pos = first + r // HEADS
    d = tl.arange(0, HEAD_DIM)
    rows = (q0 + offs_m).to(tl.int64)
    q_off = rows[:, None] * stride_qt + h[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=mmask[:, None])
    if SCALED:
        q = _fp16_for_codes(q)
    bt_row = block_tables + seq * stride_bt
    hi = tl.minimum(ctx, first + QUERIES)
    lo = 0
    full_end = (first + 1) // BLOCK_N * BLOCK_N
    if window > 0:
        lo = tl.maximum(first - window + 1, 0) // BLOCK_N * BLOCK_N
        full_end = lo
    # This split's keys: a BLOCK_N-aligned slice of [lo, hi).
    per_split = tl.cdiv(tl.cdiv(hi - lo, num_splits), BLOCK_N) * BLOCK_N
    lo = lo + split * per_split
    hi = tl.minimum(lo + per_split, hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for n0 in range(lo, tl.minimum(full_end, hi), BLOCK_N):
        acc, m_i, l_i = _extend_tile(
            acc, m_i, l_i, q, q_pos, n0, hi, k_cache, v_cache, k_scale, v_scale, bt_row, kvh,
            stride_slot, stride_kvh, stride_sslot, qk_scale, window, HEAD_DIM, BLOCK_SIZE,
            BLOCK_N, False, SCALED,
        )  # fmt: skip
    for n0 in range(tl.maximum(full_end, lo), hi, BLOCK_N):
        acc, m_i, l_i = _extend_tile(
            acc, m_i, l_i, q, q_pos, n0, hi, k_cache, v_cache, k_scale, v_scale, bt_row, kvh,
            stride_slot, stride_kvh, stride_sslot, qk_scale, window, HEAD_DIM, BLOCK_SIZE,
            BLOCK_N, True, SCALED,
        )  # fmt: skip
    mid = rows * stride_mb + h * stride_mh + split * stride_ms
    _store_partial(mid_out, mid_lse, mid, acc, m_i, l_i, mmask, HEAD_DIM, SPLIT)


def extend_attention(
    q: torch.Tensor,  # [T, heads, head_dim], each sequence's queries side by side
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_start: torch.Tensor,  # [S] int32: first row of each sequence in q
    query_lens: torch.Tensor,  # [S] int32
    context_lens: torch.Tensor,  # [S] int32: queries are the last query_len positions
    max_query_len: int,
    block_size: int,
    window: int = 0,
    # The tile: triton_backend.EXTEND_TILES picks one per chunk length, as measured.
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # of a quantized cache
    num_splits: int = 1,  # at most MAX_SPLITS: slices of each tile's keys, merged after
    heads_per_program: int = 1,  # 1, or a GQA group's query heads (rows of each tile)
) -> torch.Tensor:
    """Causal attention of new queries over their paged context (prefill, chunked prefill).

    Rows of q that belong to no sequence in the tables come out undefined.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    assert group % heads_per_program == 0 and block_m >= heads_per_program
    out = torch.empty_like(q)
    mid_out, mid_lse = split_buffers(out, num_splits)
    # Heads vary fastest so a GQA group's programs run together and share keys in L2.
    tiles = triton.cdiv(max_query_len, block_m // heads_per_program)
    grid = (num_heads // heads_per_program * num_splits, tiles, query_lens.shape[0])
    k_scale, v_scale = scales or (k_cache, v_cache)  # unread when unscaled
    _extend_kernel[grid](
        q, k_cache, v_cache, k_scale, v_scale, mid_out, mid_lse, block_tables, query_start,
        query_lens, context_lens, q.stride(0), q.stride(1), mid_out.stride(0),
        mid_out.stride(1), mid_out.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_scale.stride(0), block_tables.stride(0),
        head_dim**-0.5 * LOG2E, window, num_splits,
        GROUP=group, HEADS=heads_per_program, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, SPLIT=num_splits > 1, SCALED=scales is not None,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if num_splits > 1:
        merge_splits(mid_out, mid_lse, out)
    return out
