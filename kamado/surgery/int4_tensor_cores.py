"""int4 matmuls on tensor cores (Triton): mma.sync for two to eight bf16 input rows, with
each thread loading its fragments' words itself, and tiles for up to 16 rows, widened in
registers for tl.dot. Both widen words to bf16 by a bit trick in inline PTX. Dispatch and
tuning: kamado.surgery.triton_matmul."""

from __future__ import annotations

import triton
import triton.language as tl

from kamado.pdl import let_next_start, wait_for_inputs
from kamado.surgery.kernel_epilogues import store_tile, tile_sum

BF16_ONES = tl.constexpr(0x3F803F80)  # a bf16 pair of 1.0


def _nibble_pair_lines(word: str, t: int, pair: str) -> list[str]:
    """PTX setting `pair` to nibbles t and t + 4 of `word` (where formats.pack_int4 puts
    the word's elements 2t and 2t + 1) as a bf16 pair of 128 + q, exactly: shifted right
    4t, masked and ORed into 0x4300 (bf16's 128.0, whose low mantissa bits are zero).
    Needs a .reg .b32 t."""
    lines = [f"shr.u32 t, {word}, {4 * t};"] if t else []
    return [*lines, f"lop3.b32 {pair}, {'t' if t else word}, 0x000F000F, 0x43004300, 0xea;"]


def _int4_word_as_bf16_asm(word: str, scale: str, low: str) -> str:
    """PTX taking one word and its group's scale and min, giving the word's eight weights
    as four bf16 pairs: 128 + q (_nibble_pair_lines) less 128 is q, and one fma makes
    q * scale + min, rounded once to bf16. `word` names the word's operand, `scale` and
    `low` those of the scale and min, each a bf16 pair; $0..$3 are the pairs out."""
    lines = ["{", ".reg .b32 t, q, one, low;", f"mov.b32 one, {BF16_ONES.value:#x};"]
    lines.append("mov.b32 low, 0xC300C300;")
    for t in range(4):
        lines += [
            *_nibble_pair_lines(word, t, "q"),
            "fma.rn.bf16x2 q, q, one, low;",
            f"fma.rn.bf16x2 ${t}, q, {scale}, {low};",
        ]
    return "\n".join(["", *lines, "}", ""])


# In _int4_weights each operand comes eight times (pack=8): the first copy of each.
_INT4_WORD_AS_BF16 = tl.constexpr(_int4_word_as_bf16_asm("$4", "$12", "$16"))

_INT4_ONE_WORD_AS_BF16 = tl.constexpr(_int4_word_as_bf16_asm("$4", "$5", "$6"))

# One word ($4) as four bf16 pairs of 128 + q ($0..$3), no arithmetic.
_128_PLUS_Q_LINES = [line for t in range(4) for line in _nibble_pair_lines("$4", t, f"${t}")]
_INT4_WORD_AS_128_PLUS_Q = tl.constexpr(
    "\n".join(["", "{", ".reg .b32 t;", *_128_PLUS_Q_LINES, "}", ""])
)


# D = A @ B + C on a warp's tensor cores: A 16 x 16 bf16 (four bf16 pairs a thread), B
# 16 x 8 bf16 (two pairs), C and D 16 x 8 float32 (four a thread); PTX ISA, "Matrix
# Fragments for mma.m16n8k16", gives which thread holds which values.
_MMA_16X8X16 = tl.constexpr(
    "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
    "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};"
)


@triton.jit
def _eight_copies(t):
    """[R, W] -> [R, W, 8], each value repeated along the new last axis (in registers)."""
    t2 = tl.join(t, t)
    return tl.join(tl.join(t2, t2), tl.join(t2, t2))


@triton.jit
def _int4_weights(words, scale, low):
    """int32 words [R, W] (formats.pack_int4) of one group, and that group's scale and min
    [R] -> bf16 weights [R, 8W], word by word: column 8j + e is word j's element e (the
    inputs, reordered so, are _in_word_order).

    The asm sees each word eight times (the joins) and uses one copy, so one call fills a
    thread's eight consecutive values, already paired as the tensor cores read them."""
    shape: tl.constexpr = [words.shape[0], words.shape[1]]
    values = tl.inline_asm_elementwise(
        _INT4_WORD_AS_BF16, "=r,=r,=r,=r" + ",r" * 16,
        [_eight_copies(words), _eight_copies(tl.broadcast_to(scale[:, None], shape)),
         _eight_copies(tl.broadcast_to(low[:, None], shape))],
        dtype=tl.bfloat16, is_pure=True, pack=8,
    )  # fmt: skip
    return tl.reshape(values, [words.shape[0], words.shape[1] * 8])


@triton.jit
def _in_word_order(x):
    """Inputs [M, GROUP] -> the same, reordered as _int4_weights' columns: column
    8j + 2p + b is input p * GROUP / 4 + 2j + b (formats.pack_int4)."""
    m: tl.constexpr = x.shape[0]
    group: tl.constexpr = x.shape[1]
    pairs = tl.permute(tl.reshape(x, [m, 4, group // 8, 2]), (0, 2, 1, 3))
    return tl.reshape(pairs, [m, group])


@triton.jit
def _bf16_pairs(word, sm):
    """A word's eight weights as four bf16 pairs (_int4_word_as_bf16_asm), from the word
    and its group's scale and min (one int32: the scale in the low half)."""
    scale = (sm & 0xFFFF) | (sm << 16)
    low = ((sm >> 16) & 0xFFFF) | (sm & -65536)
    return tl.inline_asm_elementwise(
        _INT4_ONE_WORD_AS_BF16, "=r,=r,=r,=r,r,r,r", [word, scale, low],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _pairs_128_plus_q(word):
    """A word's eight weights as four bf16 pairs of 128 + q (_INT4_WORD_AS_128_PLUS_Q)."""
    return tl.inline_asm_elementwise(
        _INT4_WORD_AS_128_PLUS_Q, "=r,=r,=r,=r,r", [word],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    return tl.inline_asm_elementwise(
        _MMA_16X8X16, "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _store_mma_part(out_ptr, b_ptr, d, rows, n, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """Store one of a thread's four D values: output row `rows` of input row `n`."""
    if HAS_BIAS:
        d += tl.load(b_ptr + tl.minimum(rows, N - 1)).to(tl.float32)
    mask = (n < M) & (rows < N)
    tl.store(out_ptr + n * stride_om + rows, d.to(out_ptr.dtype.element_ty), mask=mask)


# A 16-byte load in one instruction: Triton splits loads whose pointers it cannot prove
# contiguous, and here each thread's four words must stay in that thread.
_LOAD_16_BYTES = tl.constexpr("ld.global.v4.b32 {$0, $1, $2, $3}, [$4];")


@triton.jit
def _four_words(address):
    """The four int32 at each byte address (int64, 16-byte aligned) in `address`."""
    return tl.inline_asm_elementwise(
        _LOAD_16_BYTES, "=r,=r,=r,=r,l", [address],
        dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _weight_loads(w_lo, w_hi, sm_lo, sm_hi, block, BLOCKS: tl.constexpr, GROUP: tl.constexpr):
    """What int4_mma_kernel's threads use of one block of 128 inputs (`block`, [threads],
    clamped to the last one: what lies past it adds nothing): their four words of each of
    the two weight rows, and the scale and min of those words' group in each row. w_lo
    and w_hi are byte addresses of block 0's words, sm_lo and sm_hi of its scales."""
    at = tl.minimum(block, BLOCKS - 1)
    return (
        _four_words(w_lo + at * 64), _four_words(w_hi + at * 64),
        tl.load(sm_lo + at * (128 // GROUP)), tl.load(sm_hi + at * (128 // GROUP)),
    )  # fmt: skip


@triton.jit
def _input_loads(x_pairs, block, BLOCKS: tl.constexpr, GROUP: tl.constexpr):
    """For each of a thread's words of `block` (clamped as in _weight_loads), the four
    input pairs its four weight pairs multiply: four loads of four words, the first for
    every word's pair 0, each next a quarter group on. x_pairs is the byte address of
    block 0's."""
    first = x_pairs + tl.minimum(block, BLOCKS - 1) * 256
    quarter: tl.constexpr = GROUP // 2  # bytes of a quarter group's bf16 inputs
    return (
        _four_words(first), _four_words(first + quarter), _four_words(first + 2 * quarter),
        _four_words(first + 3 * quarter),
    )  # fmt: skip


@triton.jit
def _mmas_scaled_after(c, weights, inputs, in_k):
    """A block's four words of each weight row (_weight_loads) times their inputs
    (_input_loads), added to the sums c (a thread's four D values), for groups of 128
    (the block is one group); nothing for a block past K (in_k False).

    The tensor cores multiply 128 + q, which the bit trick gives with no arithmetic
    (exact in bf16, products summed in float32), and sum the group's inputs (an A of
    ones). Then (q * scale + min) . x = scale * ((128 + q) . x) + (min - 128 scale) *
    sum(x), in float32 once a group: per word two MMAs for the products (pairs 0 and 1,
    then 2 and 3) and two for the sums."""
    w_lo, w_hi, sm_lo, sm_hi = weights
    z = tl.zeros_like(c[0])
    d0, d1, d2, d3 = z, z, z, z
    e0, e1, e2, e3 = z, z, z, z
    ones = tl.full(z.shape, BF16_ONES, tl.int32)
    for j in tl.static_range(4):
        lo0, lo1, lo2, lo3 = _pairs_128_plus_q(w_lo[j])
        hi0, hi1, hi2, hi3 = _pairs_128_plus_q(w_hi[j])
        xa, xb, xc, xd = inputs[0][j], inputs[1][j], inputs[2][j], inputs[3][j]
        d0, d1, d2, d3 = _mma(lo0, hi0, lo1, hi1, xa, xb, d0, d1, d2, d3)
        d0, d1, d2, d3 = _mma(lo2, hi2, lo3, hi3, xc, xd, d0, d1, d2, d3)
        e0, e1, e2, e3 = _mma(ones, ones, ones, ones, xa, xb, e0, e1, e2, e3)
        e0, e1, e2, e3 = _mma(ones, ones, ones, ones, xc, xd, e0, e1, e2, e3)
    sm_lo = tl.where(in_k, sm_lo, 0)  # scale and min in one int32, the scale low
    sm_hi = tl.where(in_k, sm_hi, 0)
    scale_lo = (sm_lo << 16).to(tl.float32, bitcast=True)
    scale_hi = (sm_hi << 16).to(tl.float32, bitcast=True)
    off_lo = (sm_lo & -65536).to(tl.float32, bitcast=True) - 128.0 * scale_lo
    off_hi = (sm_hi & -65536).to(tl.float32, bitcast=True) - 128.0 * scale_hi
    return (
        c[0] + scale_lo * d0 + off_lo * e0, c[1] + scale_lo * d1 + off_lo * e1,
        c[2] + scale_hi * d2 + off_hi * e2, c[3] + scale_hi * d3 + off_hi * e3,
    )  # fmt: skip


@triton.jit
def _mmas_scaled_before(c, weights, inputs, in_k):
    """As _mmas_scaled_after, for groups smaller than the block: an MMA's 16 inputs then
    span several groups (a thread's words are one group, its neighbours' others), so each
    word is made q * scale + min in bf16 (_bf16_pairs) before the tensor cores multiply
    it. A block past K multiplies zeros."""
    w_lo, w_hi, sm_lo, sm_hi = weights
    for j in tl.static_range(4):
        lo0, lo1, lo2, lo3 = _bf16_pairs(w_lo[j], sm_lo)
        hi0, hi1, hi2, hi3 = _bf16_pairs(w_hi[j], sm_hi)
        xa, xb = tl.where(in_k, inputs[0][j], 0), tl.where(in_k, inputs[1][j], 0)
        xc, xd = tl.where(in_k, inputs[2][j], 0), tl.where(in_k, inputs[3][j], 0)
        c = _mma(lo0, hi0, lo1, hi1, xa, xb, c[0], c[1], c[2], c[3])
        c = _mma(lo2, hi2, lo3, hi3, xc, xd, c[0], c[1], c[2], c[3])
    return c


@triton.jit
def int4_mma_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, WARPS: tl.constexpr,
    STAGES: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ w[rows].T for up to 8 bf16 input rows on the tensor cores
    through mma.sync, K a multiple of 128, groups of 32, 64 or 128. In groups of 128 they
    multiply 128 + q by the inputs and scale and min apply once a group in float32
    (_mmas_scaled_after); smaller groups make each weight q * scale + min in bf16 first
    (_mmas_scaled_before). x's rows start 16-byte aligned.

    Each program has 16 weight rows, one MMA tile's, and its WARPS warps take turns over
    blocks of 128 inputs. Each warp keeps the weights of its next STAGES blocks loading
    while it multiplies one, and loads its first STAGES before waiting for x
    (kamado.pdl). A small matrix is a few blocks a warp; at four rows on the H200, four
    stages read 4096x4096 and 4096x12288 15-20% faster than one (scripts/gemv_sweep.py 4
    int4-mma). Tensors here are one value a thread ([32 * WARPS], thread i holding value
    i), so each thread holds what the PTX fragments give it: lane l = 4 g + t holds words
    4t .. 4t + 3 of each block's 16 in weight rows g and g + 8, as A, and of input row g
    the inputs those words multiply, as B. A group's word j has pairs p = 0..3 that
    multiply its inputs p * GROUP / 4 + 2j (formats.pack_int4), so each word fills the
    same A fragment columns of two MMAs, and B needs no reordering: the bf16 pairs load
    as they lie. Input rows past M repeat row M - 1 (their outputs are not stored)."""
    let_next_start(PDL)
    BLOCKS: tl.constexpr = K // 128
    threads = tl.arange(0, 32 * WARPS)
    lane = threads % 32
    warp = threads // 32
    g = lane // 4
    t = lane % 4
    # Lane t's words of a block are words j0 .. j0 + 3 of the block's group `within`.
    within = 4 * t // (GROUP // 8)
    j0 = 4 * t % (GROUP // 8)
    row_lo = tl.program_id(0) * 16 + g
    lo64 = tl.minimum(row_lo, N - 1).to(tl.int64)  # rows past N: read, never stored
    hi64 = tl.minimum(row_lo + 8, N - 1).to(tl.int64)
    w_bytes = w_ptr.to(tl.int64) + 16 * t
    w_lo = w_bytes + lo64 * stride_wn * 4
    w_hi = w_bytes + hi64 * stride_wn * 4
    sm_words = sm_ptr.to(tl.pointer_type(tl.int32)) + within  # a group's scale and min
    sm_lo = sm_words + lo64 * (stride_sn // 2)
    sm_hi = sm_words + hi64 * (stride_sn // 2)
    x_row = x_ptr.to(tl.int64) + tl.minimum(g, M - 1).to(tl.int64) * stride_xm * 2
    x_pairs = x_row + 2 * (within * GROUP + 2 * j0)
    zero = tl.zeros([32 * WARPS], tl.float32)
    c = (zero, zero, zero, zero)
    ahead = ()  # the weights of the warp's next STAGES blocks, nearest first
    for s in tl.static_range(STAGES):
        block = warp + s * WARPS
        ahead = ahead + (_weight_loads(w_lo, w_hi, sm_lo, sm_hi, block, BLOCKS, GROUP),)
    wait_for_inputs(PDL)
    inputs = _input_loads(x_pairs, warp, BLOCKS, GROUP)
    for b0 in range(0, BLOCKS, WARPS):
        in_k = b0 + warp < BLOCKS
        weights = ahead[0]
        later = b0 + STAGES * WARPS + warp
        ahead = ahead[1:] + (_weight_loads(w_lo, w_hi, sm_lo, sm_hi, later, BLOCKS, GROUP),)
        next_inputs = _input_loads(x_pairs, b0 + WARPS + warp, BLOCKS, GROUP)
        if GROUP == 128:
            c = _mmas_scaled_after(c, weights, inputs, in_k)
        else:
            c = _mmas_scaled_before(c, weights, inputs, in_k)
        inputs = next_inputs
    # Each warp's sums, added across warps: thread l then holds D rows g, g + 8 and
    # columns (input rows) 2t, 2t + 1.
    c0 = tl.sum(tl.reshape(c[0], [WARPS, 32]), axis=0)
    c1 = tl.sum(tl.reshape(c[1], [WARPS, 32]), axis=0)
    c2 = tl.sum(tl.reshape(c[2], [WARPS, 32]), axis=0)
    c3 = tl.sum(tl.reshape(c[3], [WARPS, 32]), axis=0)
    lanes = tl.arange(0, 32)
    rows = tl.program_id(0) * 16 + lanes // 4
    n = 2 * (lanes % 4)
    _store_mma_part(out_ptr, b_ptr, c0, rows, n, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c1, rows, n + 1, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c2, rows + 8, n, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c3, rows + 8, n + 1, M, N, stride_om, HAS_BIAS)


@triton.jit
def int4_dot_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, partial_ptr, arrived_ptr, M, N, stride_xm, stride_wn,
    stride_sn, stride_om, K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_STEP: tl.constexpr,
    SWAP: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ w[rows].T on tensor cores, w = q * scale + min made in bf16 in
    registers (the bf16 weights the wider path multiplies too); products accumulate in
    float32 and input rows past M are zeros.

    - GROUPS_PER_STEP groups are unrolled per loop step so their loads are in flight
      together, and each step's scales and mins (sm, bf16 [N, groups, 2]) are read one
      step ahead.
    - SWAP puts the weights on the left of the product, where Hopper's tensor cores read
      them from registers.
    - SPLIT_K programs share a tile's groups, so that a matrix of few rows still gives
      every multiprocessor several programs (see sum_splits).
    - The first scales and mins are read before waiting for x (kamado.pdl)."""
    let_next_start(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    WORDS: tl.constexpr = GROUP // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    SPLIT_GROUPS: tl.constexpr = (NUM_GROUPS + SPLIT_K - 1) // SPLIT_K
    first = split * SPLIT_GROUPS
    end = tl.minimum(first + SPLIT_GROUPS, NUM_GROUPS)
    w_base = w_ptr + rows64[:, None] * stride_wn + tl.arange(0, WORDS)[None, :]
    x_base = x_ptr + ms[:, None] * stride_xm + tl.arange(0, GROUP)[None, :]
    cols = tl.arange(0, 2 * GROUPS_PER_STEP)  # scale, min, scale, min, ... of a step
    sm_ptrs = sm_ptr + rows64[:, None] * stride_sn + 2 * first + cols[None, :]
    sm_next = tl.load(sm_ptrs, mask=2 * first + cols[None, :] < 2 * end, other=0.0)
    wait_for_inputs(PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for g0 in range(first, end, GROUPS_PER_STEP):
        sm = sm_next.to(tl.float32)
        sm_ptrs += 2 * GROUPS_PER_STEP
        later = 2 * (g0 + GROUPS_PER_STEP) + cols[None, :] < 2 * end
        sm_next = tl.load(sm_ptrs, mask=later, other=0.0)
        for t in tl.static_range(GROUPS_PER_STEP):
            g = g0 + t
            ok = g < end  # False only in a last, partial step
            words = tl.load(w_base + g * WORDS, mask=ok, other=0)
            x = _in_word_order(tl.load(x_base + g * GROUP, mask=(ms < M)[:, None] & ok, other=0.0))
            scale = tl.sum(tl.where(cols[None, :] == 2 * t, sm, 0.0), axis=1)
            low = tl.sum(tl.where(cols[None, :] == 2 * t + 1, sm, 0.0), axis=1)
            w = _int4_weights(words, scale.to(tl.bfloat16), low.to(tl.bfloat16))
            acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
    acc, last = tile_sum(
        acc, ms, partial_ptr, arrived_ptr, tile, split, BLOCK_N, BLOCK_M, SWAP, SPLIT_K
    )
    if last:
        store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS)
