"""Matmuls over compressed weights on CUDA: Triton kernels for decode-sized inputs,
dequantize-then-cuBLAS for everything wider.

Decode reads every weight once per token, so its matmuls are bound by the bytes they read.
- int8 and fp8 weights at up to GEMV_MAX_ROWS input rows run a GEMV per row: it reads the
  bytes and their scales, widens them in registers and accumulates in float32. So does
  int4 at one row.
- int4 with bf16 inputs of two to INT4_MMA_MAX_ROWS rows (several agents decoding at
  once) takes mma.sync: each thread loads the words that its part of an MMA tile needs,
  widens them in registers and the tensor cores multiply them with all rows at once.
  Other inputs (fp16, float32, groups other than 128) take an int4 GEMV for up to
  INT4_GEMV_MAX_ROWS rows, which widens each word once for all rows.
- int4 weights beyond those, and int8 and fp8 from three rows, up to DOT_MAX_ROWS, go
  through tensor cores on tiles: each program widens its tile in registers (int4 through
  bit tricks, not the int-to-float instruction, which Hopper issues at an eighth of the
  FMA rate) and reads it once for all input rows.
- Wider inputs (prefill, large batches) are compute-bound: the weight is widened to the
  activation dtype once and cuBLAS does the product.
Measured per shape on an H200: `python scripts/gemv_bandwidth.py [ROWS]`, and per tile
configuration `python scripts/gemv_sweep.py` and `python scripts/dot_sweep.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kamado.pdl import launch_options, let_next_start, wait_for_inputs
from kamado.surgery.formats import WORD_ORDER, unpack_int4

GEMV_MAX_ROWS = 2
# int4's GEMV for two to four input rows reads and widens each word once for all of them,
# faster than the tile kernel there (scripts/gemv_sweep.py 2 int4 against dot_sweep.py 2
# int4); it serves what _int4_mma_kernel does not take.
INT4_GEMV_MAX_ROWS = 4
# int4 with bf16 inputs from two rows to this many (the columns of one MMA) takes
# _int4_mma_kernel; at one row the GEMV reads 4 of Qwen3-8B's 5 shapes faster
# (scripts/gemv_sweep.py 1 int4 against 1 int4-mma).
INT4_MMA_MAX_ROWS = 8
DOT_MAX_ROWS = 16  # input rows of the tensor-core kernels (one MMA tile)
# False: dense_matmul is F.linear throughout (scripts/decode_profile.py --dense-gemv
# compares the two); read at each call, so it holds for graphs captured after it is set.
dense_gemv = True

_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": split, "STEP_SUMS": sums}, num_warps=w)
    for bn, bk, w, split, sums in [
        (8, 512, 4, 1, False), (16, 1024, 8, 1, False), (32, 512, 8, 1, False),
        (8, 2048, 8, 1, False), (4, 1024, 4, 1, False), (8, 1024, 4, 4, False),
        (8, 512, 4, 8, False), (16, 512, 4, 8, False), (4, 4096, 4, 1, True),
        (8, 4096, 4, 1, True), (2, 4096, 4, 1, True), (4, 4096, 8, 1, True),
        (4, 2048, 4, 1, True), (2, 2048, 2, 1, True),
    ]
]  # fmt: skip
# Grouped int8 tiles are one group wide: the rows carry the bytes in flight.
_GROUPED_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
    for bn, bk, w in [(16, 512, 4), (32, 512, 8), (64, 256, 8), (32, 1024, 8), (64, 512, 8)]
]
_INT4_DOT_CONFIGS = [
    triton.Config(
        {"BLOCK_N": bn, "GROUPS_PER_STEP": g, "SWAP": swap, "SPLIT_K": split},
        num_warps=w, num_stages=st,
    )
    for bn, g, swap, w, st, split in [
        (64, 4, True, 4, 2, 1), (64, 4, True, 4, 3, 1), (32, 4, False, 4, 3, 1),
        (64, 4, True, 4, 2, 2), (64, 4, True, 4, 2, 4), (64, 2, True, 4, 3, 8),
        (32, 4, False, 4, 3, 4), (32, 2, False, 4, 3, 8), (16, 4, False, 4, 3, 8),
    ]
]  # fmt: skip
_INT4_GEMV_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "GROUPS_PER_STEP": g}, num_warps=w)
    for bn, g, w in [(4, 32, 4), (8, 16, 4), (4, 8, 1), (8, 8, 2), (4, 4, 1)]
]
# Two to four input rows, four weight rows a program: (GROUPS_PER_STEP, num_warps), the
# winners of scripts/gemv_sweep.py 2 int4 and 4 int4.
_INT4_GEMV_ROWS_CONFIGS = [
    triton.Config({"GROUPS_PER_STEP": g}, num_warps=w)
    for g, w in [(4, 1), (8, 1), (8, 2), (16, 2), (32, 2), (32, 4)]
]
# The warps of an _int4_mma_kernel program: winners of scripts/gemv_sweep.py 4 int4-mma.
_INT4_MMA_CONFIGS = [triton.Config({"WARPS": w}, num_warps=w) for w in (2, 4, 8)]
SPLIT_MAX_OUT = 16384  # output rows up to which an int4 matmul may split its inputs
_SPLIT_MAX = 8  # the most SPLIT_K above
_INT8_DOT_CONFIGS = [
    triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
    for bn, bk, w, st in [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 3)]
]  # fmt: skip
_FP8_DOT_CONFIGS = [
    triton.Config(
        {"BLOCK_N": bn, "BLOCK_K": bk, "SWAP": swap, "SPLIT_K": split},
        num_warps=w, num_stages=st,
    )
    for bn, bk, swap, w, st, split in [
        (64, 256, False, 4, 3, 1), (64, 512, False, 4, 3, 1), (32, 256, False, 4, 3, 1),
        (32, 512, False, 4, 3, 1), (32, 256, False, 4, 4, 2), (32, 512, False, 4, 3, 4),
        (64, 256, False, 4, 4, 4), (16, 512, False, 4, 4, 4), (64, 256, True, 4, 3, 1),
        (64, 256, True, 4, 4, 4), (128, 256, True, 4, 3, 1),
    ]
]  # fmt: skip


@triton.jit
def _store_row(out, b_ptr, out_row_ptr, rows, rows64, N, HAS_BIAS: tl.constexpr):
    """The GEMVs' last step: one input row's float32 outputs [rows], plus the bias, stored
    in the output's dtype (rows past N were computed on a clamped copy, never stored)."""
    if HAS_BIAS:
        out += tl.load(b_ptr + rows64).to(tl.float32)
    tl.store(out_row_ptr + rows, out.to(out_row_ptr.dtype.element_ty), mask=rows < N)


@triton.jit
def _rowwise_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, partial_ptr, arrived_ptr, N, stride_xm, stride_wn,
    stride_om, K: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    STEP_SUMS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = (x[m] @ q[rows].T) * scale[rows]: int8 or fp8 values, a scale per row;
    or bf16/fp16 weights as they are, without scales (dense_matmul).

    Rows past N are clamped to the last row (read, never stored) so weight loads need no
    mask when BLOCK_K divides K; pointers advance by BLOCK_K instead of being recomputed.
    SPLIT_K programs share a tile's inputs, as in _int4_dot_kernel (see _sum_splits).
    STEP_SUMS sums each tile's products along K at once, keeping a float32 per row rather
    than one per tile value: a tile may then be as wide as K, so that each thread's loads
    of a whole row slice are in flight together (a GEMV of a small matrix waits on memory
    latency, not bandwidth, when each thread has only a load or two out)."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
    m = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    K_SPLIT: tl.constexpr = (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K) * BLOCK_K
    first = split * K_SPLIT
    ks = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + first + ks[None, :]
    x_ptrs = x_ptr + m * stride_xm + first + ks
    acc = tl.zeros([BLOCK_N, 1 if STEP_SUMS else BLOCK_K], tl.float32)
    for k0 in range(first, tl.minimum(first + K_SPLIT, K), BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs)
        else:
            kmask = k0 + ks < K
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
        products = w.to(tl.float32) * x[None, :]
        acc += tl.sum(products, axis=1, keep_dims=True) if STEP_SUMS else products
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    last = True
    if SPLIT_K > 1:
        tile = m * tl.num_programs(0) + tl.program_id(0)
        out, last = _sum_splits(
            out, tl.arange(0, BLOCK_N), partial_ptr, arrived_ptr, tile, split, BLOCK_N, SPLIT_K
        )
    if last:
        if HAS_SCALE:
            out *= tl.load(s_ptr + rows64).to(tl.float32)
        _store_row(out, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)


@triton.jit
def _sum_splits(
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
def _grouped_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = sum over groups g of scale[g] * (q_g . x_g), int8 q.

    Each group is its own [rows, group] tile (BLOCK_K // GROUP of them unrolled per loop
    step, so their loads are in flight together), scaled per row and accumulated without
    reducing: the only cross-thread sum is the last one."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
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


def _int4_word_as_bf16_asm(word: str, scale: str, low: str) -> str:
    """PTX taking one word and its group's scale and min, giving the word's eight weights
    as four bf16 pairs. Pair t is nibbles t and t + 4 (where formats.pack_int4 puts the
    word's elements 2t and 2t + 1): shifted right 4t, masked and ORed into 0x4300 (bf16's
    128.0, whose low mantissa bits are zero) it reads 128 + q exactly; less 128 it is q,
    and one fma makes q * scale + min, rounded once to bf16. `word` names the word's
    operand, `scale` and `low` those of the scale and min, each a bf16 pair; $0..$3 are
    the pairs out."""
    lines = ["{", ".reg .b32 t, q, one, low;", "mov.b32 one, 0x3F803F80;"]
    lines.append("mov.b32 low, 0xC300C300;")
    for t in range(4):
        if t:
            lines.append(f"shr.u32 t, {word}, {4 * t};")
        lines += [
            f"lop3.b32 q, {'t' if t else word}, 0x000F000F, 0x43004300, 0xea;",
            "fma.rn.bf16x2 q, q, one, low;",
            f"fma.rn.bf16x2 ${t}, q, {scale}, {low};",
        ]
    return "\n".join(["", *lines, "}", ""])


# In _int4_weights each operand comes eight times (pack=8): the first copy of each.
_INT4_WORD_AS_BF16 = tl.constexpr(_int4_word_as_bf16_asm("$4", "$12", "$16"))
_INT4_ONE_WORD_AS_BF16 = tl.constexpr(_int4_word_as_bf16_asm("$4", "$5", "$6"))
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


def _nibble_floats(word: str) -> list[tuple[int, list[str]]]:
    """PTX putting each weight of an int4 word (formats.pack_int4) into register f as the
    float32 128 + q, one element after another: (element, the lines that fill f) in nibble
    order. Masking the word and the word shifted by 4 with 0x0F0F0F0F leaves each q alone
    in a byte; one prmt puts that byte under 0x43000000 (float32's 128.0, whose low mantissa
    bits are zero), which then reads 128 + q exactly: no int-to-float conversion, which
    Hopper issues at an eighth of the FMA rate. Uses registers lo, hi, f and magic (set to
    0x43000000 by the caller)."""
    first = [f"and.b32 lo, {word}, 0x0F0F0F0F;", f"shr.u32 hi, {word}, 4;"]
    first.append("and.b32 hi, hi, 0x0F0F0F0F;")
    steps = []
    # Nibble i holds element WORD_ORDER[i]; lo has the even nibbles, hi the odd.
    for nibble, element in enumerate(WORD_ORDER):
        source, byte = ("lo", "hi")[nibble % 2], nibble // 2
        lines = [f"prmt.b32 f, {source}, magic, 0x{0x7044 | byte << 8:04x};"]
        steps.append((element, (first if nibble == 0 else []) + lines))
    return steps


_PTX_START = ["{", ".reg .b32 lo, hi, f, magic;", "mov.b32 magic, 0x43000000;"]


def _int4_word_dot_asm(rows: int) -> str:
    """PTX taking a word of each of `rows` weight rows and the inputs of a word's eight
    elements as float32, giving for each row the sum over them of input * (128 + q)
    (_nibble_floats). $0.. are the sums out, then the words, then the eight inputs in
    element order."""
    lines = list(_PTX_START)
    for row in range(rows):
        for nibble, (element, widen) in enumerate(_nibble_floats(f"${rows + row}")):
            out, x = f"${row}", f"${2 * rows + element}"
            lines += widen
            lines.append(
                f"mul.rn.f32 {out}, f, {x};" if nibble == 0
                else f"fma.rn.f32 {out}, f, {x}, {out};"
            )  # fmt: skip
    return "\n".join(["", *lines, "}", ""])


def _int4_word_fma_asm(rows: int) -> str:
    """PTX taking a word, its group's scale and offset (min - 128 * scale) as float32, and
    for each of `rows` input rows a running sum and the inputs of the word's eight
    elements, giving each row's sum plus those inputs times the word's weights. Each weight
    is widened once (_nibble_floats, then scale * (128 + q) + offset, q * scale + min) for
    every input row. $0.. are the sums out, then the word, scale, offset, the sums in, and
    each row's eight inputs in element order."""
    lines = [*_PTX_START, ".reg .b32 w;"]
    word, scale, offset = f"${rows}", f"${rows + 1}", f"${rows + 2}"
    for nibble, (element, widen) in enumerate(_nibble_floats(word)):
        lines += widen
        lines.append(f"fma.rn.f32 w, f, {scale}, {offset};")
        for row in range(rows):
            out, x = f"${row}", f"${2 * rows + 3 + 8 * row + element}"
            sum_in = f"${rows + 3 + row}" if nibble == 0 else out
            lines.append(f"fma.rn.f32 {out}, w, {x}, {sum_in};")
    return "\n".join(["", *lines, "}", ""])


_INT4_FOUR_WORDS_DOT = tl.constexpr(_int4_word_dot_asm(4))
_INT4_WORD_TWO_ROWS_FMA = tl.constexpr(_int4_word_fma_asm(2))
_INT4_WORD_FOUR_ROWS_FMA = tl.constexpr(_int4_word_fma_asm(4))


@triton.jit
def _per_row(x, words):
    """Inputs [groups, words] as float32 bits beside every row's words [rows, groups, words]."""
    return tl.broadcast_to(x[None, :, :], words.shape).to(tl.int32, bitcast=True)


@triton.jit
def _input_pairs(x_row, pairs_at, mask):
    """Inputs 2i and 2i + 1 of the row at x_row as float32, for each pair index i in
    pairs_at. A 16-bit pair loads as one int32 and widens by a shift or a mask."""
    if x_row.dtype.element_ty == tl.float32:
        first = tl.load(x_row + 2 * pairs_at, mask=mask, other=0.0)
        return first, tl.load(x_row + 2 * pairs_at + 1, mask=mask, other=0.0)
    pairs = tl.load(x_row.to(tl.pointer_type(tl.int32)) + pairs_at, mask=mask, other=0)
    if x_row.dtype.element_ty == tl.bfloat16:  # a bf16 is a float32's high half
        first = (pairs << 16).to(tl.float32, bitcast=True)
        return first, (pairs & -65536).to(tl.float32, bitcast=True)
    first = pairs.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return first, (pairs >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _row_quarter(w_ptr, sm_ptr, quarter, first, QUARTER: tl.constexpr, N, stride_wn, stride_sn,
                 words_at, gs):  # fmt: skip
    """One quarter of a GEMV program's weight rows: (rows, rows clamped in int64, pointers
    to their words of a step, to their groups' scales and mins)."""
    rows = first + quarter * QUARTER + tl.arange(0, QUARTER)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows64[:, None, None] * stride_wn + words_at[None, :, :]
    return rows, rows64, w_ptrs, sm_ptr + rows64[:, None] * stride_sn + 2 * gs[None, :]


@triton.jit
def _word_inputs(x_row, pairs_at, WORDS: tl.constexpr, ok):
    """The eight inputs of each word of a step (element order, float32 [groups, words]
    each) of the row at x_row, and their sum. A word's first pair is at pairs_at, its
    others WORDS, 2 WORDS and 3 WORDS pairs on (formats.pack_int4)."""
    x0, x1 = _input_pairs(x_row, pairs_at, ok[:, None])
    x2, x3 = _input_pairs(x_row, pairs_at + WORDS, ok[:, None])
    x4, x5 = _input_pairs(x_row, pairs_at + 2 * WORDS, ok[:, None])
    x6, x7 = _input_pairs(x_row, pairs_at + 3 * WORDS, ok[:, None])
    return x0, x1, x2, x3, x4, x5, x6, x7, (x0 + x1) + (x2 + x3) + ((x4 + x5) + (x6 + x7))


@triton.jit
def _scale_offset(sm_ptrs, ok):
    """Each word's group scale and min - 128 * scale, float32 [rows, groups, 1]."""
    scale = tl.load(sm_ptrs, mask=ok[None, :], other=0.0).to(tl.float32)
    low = tl.load(sm_ptrs + 1, mask=ok[None, :], other=0.0).to(tl.float32)
    return scale[:, :, None], (low - 128.0 * scale)[:, :, None]


@triton.jit
def _scaled(dots, scale, offset, word_sums):
    """Each word's part of its row's sum: scale * dot + (min - 128 * scale) * its inputs'
    sum, from the float32 bits `dots` of _int4_word_dot_asm (the others broadcast to it)."""
    return scale * dots.to(tl.float32, bitcast=True) + offset * word_sums


@triton.jit
def _int4_gemv_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = x[m] @ w[rows].T on CUDA cores, w = q * scale + min (int4 words,
    scale and min per group in sm, bf16 [N, groups, 2]); x's rows start 4-byte aligned.

    - A word's inputs are four pairs (formats.pack_int4), each loaded in the words' own
      layout, so no value moves between threads until the end.
    - The program's rows are four quarters, and one asm (_int4_word_dot_asm) takes a word
      of each with the inputs widened once: x * (128 + q) for each. Then
      scale * that + (min - 128 * scale) * (the word's inputs summed) is the word's part
      of its row's sum. The subtraction costs float32 about four of its 24 bits, well
      under the bf16 rounding of the output.
    - A float32 per word of the tile accumulates across steps; only the last step sums
      across threads."""
    let_next_start(PDL)
    m = tl.program_id(1).to(tl.int64)
    QUARTER: tl.constexpr = BLOCK_N // 4
    first = tl.program_id(0) * BLOCK_N
    WORDS: tl.constexpr = GROUP // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    gs = tl.arange(0, GROUPS_PER_STEP)
    words_at = gs[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [groups, words] of a step
    r0, r0_64, w0, s0 = _row_quarter(
        w_ptr, sm_ptr, 0, first, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # noqa: E501
    r1, r1_64, w1, s1 = _row_quarter(
        w_ptr, sm_ptr, 1, first, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # noqa: E501
    r2, r2_64, w2, s2 = _row_quarter(
        w_ptr, sm_ptr, 2, first, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # noqa: E501
    r3, r3_64, w3, s3 = _row_quarter(
        w_ptr, sm_ptr, 3, first, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # noqa: E501
    x_row = x_ptr + m * stride_xm
    # Each word's first pair; its others are WORDS, 2 WORDS and 3 WORDS pairs on.
    pairs_at = gs[:, None] * (GROUP // 2) + tl.arange(0, WORDS)[None, :]
    wait_for_inputs(PDL)
    acc0 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc1 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc2 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc3 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    for g0 in range(0, NUM_GROUPS, GROUPS_PER_STEP):
        ok = g0 + gs < NUM_GROUPS  # False only in a last, partial step
        q0 = tl.load(w0, mask=ok[None, :, None], other=0)
        q1 = tl.load(w1, mask=ok[None, :, None], other=0)
        q2 = tl.load(w2, mask=ok[None, :, None], other=0)
        q3 = tl.load(w3, mask=ok[None, :, None], other=0)
        x0, x1, x2, x3, x4, x5, x6, x7, word_sums = _word_inputs(x_row, pairs_at, WORDS, ok)
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _INT4_FOUR_WORDS_DOT, "=r,=r,=r,=r" + ",r" * 12,
            [q0, q1, q2, q3, _per_row(x0, q0), _per_row(x1, q0), _per_row(x2, q0),
             _per_row(x3, q0), _per_row(x4, q0), _per_row(x5, q0), _per_row(x6, q0),
             _per_row(x7, q0)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
        scale0, offset0 = _scale_offset(s0, ok)
        acc0 += _scaled(d0, scale0, offset0, word_sums[None, :, :])
        scale1, offset1 = _scale_offset(s1, ok)
        acc1 += _scaled(d1, scale1, offset1, word_sums[None, :, :])
        scale2, offset2 = _scale_offset(s2, ok)
        acc2 += _scaled(d2, scale2, offset2, word_sums[None, :, :])
        scale3, offset3 = _scale_offset(s3, ok)
        acc3 += _scaled(d3, scale3, offset3, word_sums[None, :, :])
        w0 += GROUPS_PER_STEP * WORDS
        w1 += GROUPS_PER_STEP * WORDS
        w2 += GROUPS_PER_STEP * WORDS
        w3 += GROUPS_PER_STEP * WORDS
        s0 += 2 * GROUPS_PER_STEP
        s1 += 2 * GROUPS_PER_STEP
        s2 += 2 * GROUPS_PER_STEP
        s3 += 2 * GROUPS_PER_STEP
        pairs_at += GROUPS_PER_STEP * (GROUP // 2)
    out_row = out_ptr + m * stride_om
    _store_row(tl.sum(tl.sum(acc0, axis=2), axis=1), b_ptr, out_row, r0, r0_64, N, HAS_BIAS)
    _store_row(tl.sum(tl.sum(acc1, axis=2), axis=1), b_ptr, out_row, r1, r1_64, N, HAS_BIAS)
    _store_row(tl.sum(tl.sum(acc2, axis=2), axis=1), b_ptr, out_row, r2, r2_64, N, HAS_BIAS)
    _store_row(tl.sum(tl.sum(acc3, axis=2), axis=1), b_ptr, out_row, r3, r3_64, N, HAS_BIAS)


@triton.jit
def _four_rows(row0, row1, row2, row3, at, mask):
    """What lies `at` ([groups, words] or [groups] offsets) past each of four row
    pointers, as one tensor with two more axes, each thread holding all four rows' values
    (tl.join): [..., i, j] is row 2j + i's."""
    return tl.join(
        tl.join(tl.load(row0 + at, mask=mask, other=0), tl.load(row1 + at, mask=mask, other=0)),
        tl.join(tl.load(row2 + at, mask=mask, other=0), tl.load(row3 + at, mask=mask, other=0)),
    )


@triton.jit
def _bits_beside(t, words):
    """float32 t, broadcast to the shape of words, as int32 bits (an asm operand)."""
    return tl.broadcast_to(t, words.shape).to(tl.int32, bitcast=True)


@triton.jit
def _beside_four(x, words):
    """Inputs [groups, words] as float32 bits beside four rows' words [groups, words, 2, 2]."""
    return _bits_beside(x[:, :, None, None], words)


@triton.jit
def _tile_sums(acc):
    """Running sums [groups, words, 2, 2] (float32 bits) -> each weight row's sum [2, 2]."""
    return tl.sum(tl.sum(acc.to(tl.float32, bitcast=True), axis=1), axis=0)


@triton.jit
def _int4_gemv_rows_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ w[rows].T for 2 <= M <= ROWS (2 or 4) input rows, on CUDA cores
    as _int4_gemv_kernel for one, but each word is read and widened once for all input
    rows: one asm (_int4_word_fma_asm) widens a word's weights and adds their products
    with every input row's inputs to that row's running sums, a float32 per word of the
    tile. Input rows past M repeat the last one and are never stored.

    Each program has four weight rows, joined so that each thread holds a word of all
    four (_four_rows): a word's inputs, loaded as 16-bit pairs and widened, then serve four
    words without moving between threads."""
    let_next_start(PDL)
    WORDS: tl.constexpr = GROUP // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    first = tl.program_id(0) * 4
    w0 = w_ptr + tl.minimum(first, N - 1).to(tl.int64) * stride_wn
    w1 = w_ptr + tl.minimum(first + 1, N - 1).to(tl.int64) * stride_wn
    w2 = w_ptr + tl.minimum(first + 2, N - 1).to(tl.int64) * stride_wn
    w3 = w_ptr + tl.minimum(first + 3, N - 1).to(tl.int64) * stride_wn
    s0 = sm_ptr + tl.minimum(first, N - 1).to(tl.int64) * stride_sn
    s1 = sm_ptr + tl.minimum(first + 1, N - 1).to(tl.int64) * stride_sn
    s2 = sm_ptr + tl.minimum(first + 2, N - 1).to(tl.int64) * stride_sn
    s3 = sm_ptr + tl.minimum(first + 3, N - 1).to(tl.int64) * stride_sn
    gs = tl.arange(0, GROUPS_PER_STEP)
    words_at = gs[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [groups, words] of a step
    x_a = x_ptr
    x_b = x_ptr + stride_xm
    x_c = x_ptr + tl.minimum(2, M - 1) * stride_xm
    x_d = x_ptr + tl.minimum(3, M - 1) * stride_xm
    # Each word's first pair; its others are WORDS, 2 WORDS and 3 WORDS pairs on.
    pairs_at = gs[:, None] * (GROUP // 2) + tl.arange(0, WORDS)[None, :]
    wait_for_inputs(PDL)
    # Each input row's running sums per word of the tile, as float32 bits (0 is 0.0).
    acc_a = tl.zeros([GROUPS_PER_STEP, WORDS, 2, 2], tl.int32)
    acc_b = tl.zeros([GROUPS_PER_STEP, WORDS, 2, 2], tl.int32)
    acc_c = tl.zeros([GROUPS_PER_STEP, WORDS, 2, 2], tl.int32)
    acc_d = tl.zeros([GROUPS_PER_STEP, WORDS, 2, 2], tl.int32)
    for g0 in range(0, NUM_GROUPS, GROUPS_PER_STEP):
        ok = g0 + gs < NUM_GROUPS  # False only in a last, partial step
        q = _four_rows(w0, w1, w2, w3, g0 * WORDS + words_at, ok[:, None])
        sm_at = 2 * (g0 + gs)
        scale = _four_rows(s0, s1, s2, s3, sm_at, ok).to(tl.float32)
        low = _four_rows(s0, s1, s2, s3, sm_at + 1, ok).to(tl.float32)
        offset = _bits_beside((low - 128.0 * scale)[:, None, :, :], q)
        scale = _bits_beside(scale[:, None, :, :], q)
        a0, a1, a2, a3, a4, a5, a6, a7, _ = _word_inputs(x_a, pairs_at, WORDS, ok)
        b0, b1, b2, b3, b4, b5, b6, b7, _ = _word_inputs(x_b, pairs_at, WORDS, ok)
        if ROWS == 2:
            acc_a, acc_b = tl.inline_asm_elementwise(
                _INT4_WORD_TWO_ROWS_FMA, "=r,=r" + ",r" * 21,
                [q, scale, offset, acc_a, acc_b, _beside_four(a0, q), _beside_four(a1, q),
                 _beside_four(a2, q), _beside_four(a3, q), _beside_four(a4, q),
                 _beside_four(a5, q), _beside_four(a6, q), _beside_four(a7, q),
                 _beside_four(b0, q), _beside_four(b1, q), _beside_four(b2, q),
                 _beside_four(b3, q), _beside_four(b4, q), _beside_four(b5, q),
                 _beside_four(b6, q), _beside_four(b7, q)],
                dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
            )  # fmt: skip
        else:
            c0, c1, c2, c3, c4, c5, c6, c7, _ = _word_inputs(x_c, pairs_at, WORDS, ok)
            d0, d1, d2, d3, d4, d5, d6, d7, _ = _word_inputs(x_d, pairs_at, WORDS, ok)
            acc_a, acc_b, acc_c, acc_d = tl.inline_asm_elementwise(
                _INT4_WORD_FOUR_ROWS_FMA, "=r,=r,=r,=r" + ",r" * 39,
                [q, scale, offset, acc_a, acc_b, acc_c, acc_d, _beside_four(a0, q),
                 _beside_four(a1, q), _beside_four(a2, q), _beside_four(a3, q),
                 _beside_four(a4, q), _beside_four(a5, q), _beside_four(a6, q),
                 _beside_four(a7, q), _beside_four(b0, q), _beside_four(b1, q),
                 _beside_four(b2, q), _beside_four(b3, q), _beside_four(b4, q),
                 _beside_four(b5, q), _beside_four(b6, q), _beside_four(b7, q),
                 _beside_four(c0, q), _beside_four(c1, q), _beside_four(c2, q),
                 _beside_four(c3, q), _beside_four(c4, q), _beside_four(c5, q),
                 _beside_four(c6, q), _beside_four(c7, q), _beside_four(d0, q),
                 _beside_four(d1, q), _beside_four(d2, q), _beside_four(d3, q),
                 _beside_four(d4, q), _beside_four(d5, q), _beside_four(d6, q),
                 _beside_four(d7, q)],
                dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
            )  # fmt: skip
        pairs_at += GROUPS_PER_STEP * (GROUP // 2)
    rows = first + tl.arange(0, 2)[:, None] + 2 * tl.arange(0, 2)[None, :]  # _four_rows' order
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    out_a = _tile_sums(acc_a)
    _store_row(out_a, b_ptr, out_ptr, rows, rows64, N, HAS_BIAS)
    out_b = _tile_sums(acc_b)
    _store_row(out_b, b_ptr, out_ptr + stride_om, rows, rows64, N, HAS_BIAS)
    if ROWS == 4:  # an input row past M stores no output row (a count of 0)
        out_c = _tile_sums(acc_c)
        _store_row(
            out_c, b_ptr, out_ptr + 2 * stride_om, rows, rows64, tl.where(M > 2, N, 0), HAS_BIAS
        )
        out_d = _tile_sums(acc_d)
        _store_row(
            out_d, b_ptr, out_ptr + 3 * stride_om, rows, rows64, tl.where(M > 3, N, 0), HAS_BIAS
        )


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
def _group_loads(w_lo, w_hi, sm_lo, sm_hi, x_pairs, group, NUM_GROUPS: tl.constexpr):
    """What _int4_mma_kernel's threads use of one group each (`group`, [threads], clamped
    to the last one: what lies past it is multiplied by zeros): their four words of the
    two weight rows, the rows' scale and min, and for each of the words' four pairs their
    four input pairs. w_lo, w_hi and x_pairs are byte addresses of group 0's."""
    at = tl.minimum(group, NUM_GROUPS - 1)
    wl0, wl1, wl2, wl3 = _four_words(w_lo + at * 64)
    wh0, wh1, wh2, wh3 = _four_words(w_hi + at * 64)
    xa0, xa1, xa2, xa3 = _four_words(x_pairs + at * 256)
    xb0, xb1, xb2, xb3 = _four_words(x_pairs + at * 256 + 64)
    xc0, xc1, xc2, xc3 = _four_words(x_pairs + at * 256 + 128)
    xd0, xd1, xd2, xd3 = _four_words(x_pairs + at * 256 + 192)
    return (
        wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3, tl.load(sm_lo + at), tl.load(sm_hi + at),
        xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3, xc0, xc1, xc2, xc3, xd0, xd1, xd2, xd3,
    )  # fmt: skip


@triton.jit
def _word_mmas(c0, c1, c2, c3, w_lo, w_hi, s_lo, s_hi, xa, xb, xc, xd, real):
    """A word of each of the two weight rows times its inputs, added to the sums: two
    MMAs, the first for the words' pairs 0 and 1, the second for 2 and 3."""
    lo0, lo1, lo2, lo3 = _bf16_pairs(w_lo, s_lo)
    hi0, hi1, hi2, hi3 = _bf16_pairs(w_hi, s_hi)
    c0, c1, c2, c3 = _mma(
        lo0, hi0, lo1, hi1, tl.where(real, xa, 0), tl.where(real, xb, 0), c0, c1, c2, c3
    )
    return _mma(lo2, hi2, lo3, hi3, tl.where(real, xc, 0), tl.where(real, xd, 0), c0, c1, c2, c3)


@triton.jit
def _int4_mma_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, WARPS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ w[rows].T for up to 8 bf16 input rows, groups of 128, on the
    tensor cores through mma.sync: w = q * scale + min made in bf16 in registers (the
    bf16 weights the wider path multiplies too), products summed in float32. x's rows
    start 16-byte aligned.

    Each program has 16 weight rows, one MMA tile's, and its WARPS warps take turns over
    the groups, each loading its next group before using this one. Tensors here are one
    value a thread ([32 * WARPS], thread i holding value i), so each thread holds what
    the PTX fragments give it: lane l = 4 g + t holds words 4t .. 4t + 3 of each group's
    16 in weight rows g and g + 8, as A, and of input row g the inputs those words
    multiply, as B. A word's pairs p = 0..3 multiply inputs 32 p + 2j (formats.pack_int4),
    so each word fills the same A fragment columns of two MMAs, and B needs no
    reordering: the bf16 pairs load as they lie. Input rows past M are zeros."""
    let_next_start(PDL)
    NUM_GROUPS: tl.constexpr = K // 128
    threads = tl.arange(0, 32 * WARPS)
    lane = threads % 32
    warp = threads // 32
    g = lane // 4
    t = lane % 4
    row_lo = tl.program_id(0) * 16 + g
    w_bytes = w_ptr.to(tl.int64) + 16 * t
    w_lo = w_bytes + tl.minimum(row_lo, N - 1).to(tl.int64) * stride_wn * 4
    w_hi = w_bytes + tl.minimum(row_lo + 8, N - 1).to(tl.int64) * stride_wn * 4
    sm_words = sm_ptr.to(tl.pointer_type(tl.int32))  # a group's scale and min in one int32
    sm_lo = sm_words + tl.minimum(row_lo, N - 1).to(tl.int64) * (stride_sn // 2)
    sm_hi = sm_words + tl.minimum(row_lo + 8, N - 1).to(tl.int64) * (stride_sn // 2)
    x_pairs = x_ptr.to(tl.int64) + tl.minimum(g, M - 1).to(tl.int64) * stride_xm * 2 + 16 * t
    c0 = tl.zeros([32 * WARPS], tl.float32)
    c1 = tl.zeros([32 * WARPS], tl.float32)
    c2 = tl.zeros([32 * WARPS], tl.float32)
    c3 = tl.zeros([32 * WARPS], tl.float32)
    wait_for_inputs(PDL)
    (wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3, s_lo, s_hi, xa0, xa1, xa2, xa3, xb0, xb1, xb2, xb3,
     xc0, xc1, xc2, xc3, xd0, xd1, xd2, xd3) = _group_loads(
        w_lo, w_hi, sm_lo, sm_hi, x_pairs, warp, NUM_GROUPS
    )  # fmt: skip
    for g0 in range(0, NUM_GROUPS, WARPS):
        real = (g < M) & (g0 + warp < NUM_GROUPS)
        (nl0, nl1, nl2, nl3, nh0, nh1, nh2, nh3, n_lo, n_hi, ya0, ya1, ya2, ya3, yb0, yb1,
         yb2, yb3, yc0, yc1, yc2, yc3, yd0, yd1, yd2, yd3) = _group_loads(
            w_lo, w_hi, sm_lo, sm_hi, x_pairs, g0 + WARPS + warp, NUM_GROUPS
        )  # fmt: skip
        c0, c1, c2, c3 = _word_mmas(c0, c1, c2, c3, wl0, wh0, s_lo, s_hi, xa0, xb0, xc0, xd0, real)
        c0, c1, c2, c3 = _word_mmas(c0, c1, c2, c3, wl1, wh1, s_lo, s_hi, xa1, xb1, xc1, xd1, real)
        c0, c1, c2, c3 = _word_mmas(c0, c1, c2, c3, wl2, wh2, s_lo, s_hi, xa2, xb2, xc2, xd2, real)
        c0, c1, c2, c3 = _word_mmas(c0, c1, c2, c3, wl3, wh3, s_lo, s_hi, xa3, xb3, xc3, xd3, real)
        (wl0, wl1, wl2, wl3, wh0, wh1, wh2, wh3, s_lo, s_hi, xa0, xa1, xa2, xa3, xb0, xb1, xb2,
         xb3, xc0, xc1, xc2, xc3, xd0, xd1, xd2, xd3) = (
            nl0, nl1, nl2, nl3, nh0, nh1, nh2, nh3, n_lo, n_hi, ya0, ya1, ya2, ya3, yb0, yb1,
            yb2, yb3, yc0, yc1, yc2, yc3, yd0, yd1, yd2, yd3,
        )  # fmt: skip
    # Each warp's sums, added across warps: thread l then holds D rows g, g + 8 and
    # columns (input rows) 2t, 2t + 1.
    c0 = tl.sum(tl.reshape(c0, [WARPS, 32]), axis=0)
    c1 = tl.sum(tl.reshape(c1, [WARPS, 32]), axis=0)
    c2 = tl.sum(tl.reshape(c2, [WARPS, 32]), axis=0)
    c3 = tl.sum(tl.reshape(c3, [WARPS, 32]), axis=0)
    lanes = tl.arange(0, 32)
    rows = tl.program_id(0) * 16 + lanes // 4
    n = 2 * (lanes % 4)
    _store_mma_part(out_ptr, b_ptr, c0, rows, n, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c1, rows, n + 1, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c2, rows + 8, n, M, N, stride_om, HAS_BIAS)
    _store_mma_part(out_ptr, b_ptr, c3, rows + 8, n + 1, M, N, stride_om, HAS_BIAS)


@triton.jit
def _int4_dot_kernel(
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
      every multiprocessor several programs (see _sum_splits).
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
    if SWAP:
        acc = tl.trans(acc)
    last = True
    if SPLIT_K > 1:
        elems = ms[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc, last = _sum_splits(
            acc, elems, partial_ptr, arrived_ptr, tile, split, BLOCK_M * BLOCK_N, SPLIT_K
        )
    if last:
        _store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS)


@triton.jit
def _int8_dot_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ (q * scale)[rows].T on tensor cores, for int8 q with a scale per
    row (GROUP = K) or per group: q is exact in bf16, x stays bf16, products accumulate in
    float32 and each group's sum is scaled once. Input rows past M are zeros."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    TILE: tl.constexpr = BLOCK_K if GROUP > BLOCK_K else GROUP
    ks = tl.arange(0, TILE)
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + ks[None, :]
    x_ptrs = x_ptr + ms[:, None] * stride_xm + ks[None, :]
    s_base = s_ptr + rows64 * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, TILE):
        if K % TILE == 0:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None], other=0.0)
        else:  # a scale per row and a last, partial tile
            kmask = k0 + ks < K
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None] & kmask[None, :], other=0.0)
        w = w.to(tl.bfloat16)
        if GROUP == K:
            acc = tl.dot(x, tl.trans(w), acc)
        else:
            scale = tl.load(s_base + k0 // GROUP).to(tl.float32)
            acc += tl.dot(x, tl.trans(w)) * scale[None, :]
        w_ptrs += TILE
        x_ptrs += TILE
    if GROUP == K:
        acc *= tl.load(s_base).to(tl.float32)[None, :]
    _store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS)


@triton.jit
def _store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS: tl.constexpr):
    """The tensor-core kernels' last step: float32 [BLOCK_M, BLOCK_N] plus the bias, stored
    in the output's dtype for the real input rows and output rows."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + rows64).to(tl.float32)[None, :]
    mask = (ms < M)[:, None] & (rows < N)[None, :]
    out = acc.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + ms[:, None] * stride_om + rows[None, :], out, mask=mask)


@triton.jit
def _fp8_dot_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, partial_ptr, arrived_ptr, M, N, stride_xm, stride_wn,
    stride_om, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, SWAP: tl.constexpr, SPLIT_K: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = (x @ q[rows].T) * scale[rows] on tensor cores, in fp16: e4m3 values
    are exact in fp16, x rounds to it (clamped to its range; three more mantissa bits than
    bf16), and products accumulate in float32. Input rows past M are zeros. SWAP and
    SPLIT_K as in _int4_dot_kernel: the weights on the left of the product, read by the
    tensor cores from registers; programs that share a tile's inputs (see _sum_splits)."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    K_SPLIT: tl.constexpr = (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K) * BLOCK_K
    first = split * K_SPLIT
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + first + ks[None, :]
    x_ptrs = x_ptr + ms[:, None] * stride_xm + first + ks[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(first, tl.minimum(first + K_SPLIT, K), BLOCK_K):
        if K % BLOCK_K == 0:
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None], other=0.0)
        else:
            kmask = k0 + ks < K
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=(ms < M)[:, None] & kmask[None, :], other=0.0)
        x16 = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)  # fp16's range
        w16 = w.to(tl.float16)
        acc = tl.dot(w16, tl.trans(x16), acc) if SWAP else tl.dot(x16, tl.trans(w16), acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)
    last = True
    if SPLIT_K > 1:
        elems = ms[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        acc, last = _sum_splits(
            acc, elems, partial_ptr, arrived_ptr, tile, split, BLOCK_M * BLOCK_N, SPLIT_K
        )
    if last:
        acc *= tl.load(s_ptr + rows64).to(tl.float32)[None, :]
        _store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS)


def _tuned_per_rows(kernel, configs: list[triton.Config], **options) -> Callable[[int], Any]:
    """kernel autotuned per weight shape on first use (the engine's warm-up, before graph
    capture), and separately per power-of-two count of input rows: the best tile for one
    row is not the best for two, and else the first call's rows would choose for all."""
    tuners: dict[int, Any] = {}

    def for_rows(rows: int) -> Any:
        bucket = triton.next_power_of_2(rows)
        if bucket not in tuners:
            tuners[bucket] = triton.autotune(configs=configs, **options)(kernel)
        return tuners[bucket]

    return for_rows


def _split_fits(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Configurations that split K only for matrices of few enough rows."""
    return [c for c in configs if c.kwargs["SPLIT_K"] == 1 or named_args["N"] <= SPLIT_MAX_OUT]


_rowwise_tuned = _tuned_per_rows(
    _rowwise_kernel, _CONFIGS, key=["N", "K"],
    prune_configs_by={"early_config_prune": _split_fits},
)  # fmt: skip
_grouped_tuned = _tuned_per_rows(_grouped_kernel, _GROUPED_CONFIGS, key=["N", "K", "GROUP"])
_int4_dot_tuned = _tuned_per_rows(
    _int4_dot_kernel, _INT4_DOT_CONFIGS, key=["N", "K", "GROUP"],
    prune_configs_by={"early_config_prune": _split_fits},
)  # fmt: skip
_int4_gemv_tuned = _tuned_per_rows(_int4_gemv_kernel, _INT4_GEMV_CONFIGS, key=["N", "K", "GROUP"])
_int4_mma_tuned = _tuned_per_rows(_int4_mma_kernel, _INT4_MMA_CONFIGS, key=["N", "K"])
_int4_gemv_rows_tuned = _tuned_per_rows(
    _int4_gemv_rows_kernel, _INT4_GEMV_ROWS_CONFIGS, key=["N", "K", "GROUP"]
)
_int8_dot_tuned = _tuned_per_rows(_int8_dot_kernel, _INT8_DOT_CONFIGS, key=["N", "K", "GROUP"])
_fp8_dot_tuned = _tuned_per_rows(
    _fp8_dot_kernel, _FP8_DOT_CONFIGS, key=["N", "K"],
    prune_configs_by={"early_config_prune": _split_fits},
)  # fmt: skip


def _per_row_grid(n: int, rows: int) -> Callable[[dict], tuple[int, int, int]]:
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), rows, meta.get("SPLIT_K", 1))


def _optional_arg(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """t, or x in its place where t is None: the kernel's flag for it (HAS_BIAS, HAS_SCALE)
    is then off, and the pointer is never read."""
    return t if t is not None else x


def _gemv(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor | None, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 or fp8 rows with a scale per row or per group, or bf16/fp16 rows (no scales)."""
    x = x.contiguous()
    n, k = q.shape
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = _per_row_grid(n, x.shape[0])
    if scales is None or scales.shape[1] == 1:
        _rowwise_tuned(x.shape[0])[grid](
            x, q, _optional_arg(x, scales), _optional_arg(x, bias), out,
            *split_buffers(x.device), n, x.stride(0), q.stride(0), out.stride(0), K=k,
            HAS_SCALE=scales is not None, HAS_BIAS=bias is not None, **launch_options(x.device),
        )  # fmt: skip
        return out
    _grouped_tuned(x.shape[0])[grid](
        x, q, scales, _optional_arg(x, bias), out, n, x.stride(0), q.stride(0), scales.stride(0),
        out.stride(0), K=k, GROUP=k // scales.shape[1], HAS_BIAS=bias is not None,
        **launch_options(x.device),
    )  # fmt: skip
    return out


def _dot_grid(n: int) -> Callable[[dict], tuple[int, int]]:
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta.get("SPLIT_K", 1))


_split_buffers: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def split_buffers(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float32 partial sums, int32 arrival counts, zero between calls) for split-K: room
    for any tile size of a matrix of up to SPLIT_MAX_OUT rows, at up to DOT_MAX_ROWS inputs
    on tensor cores or GEMV_MAX_ROWS in the GEMV (whose tiles are one input row each).

    One set per device, made at first use (the engine's warm-up, before graph capture) and
    shared by every call: the model's matmuls run one after another on one stream."""
    if device not in _split_buffers:
        tiles = (SPLIT_MAX_OUT + 256) * GEMV_MAX_ROWS  # a count per output row: any BLOCK_N
        partials = torch.empty(
            (SPLIT_MAX_OUT + 256) * _SPLIT_MAX * DOT_MAX_ROWS, dtype=torch.float32, device=device
        )
        _split_buffers[device] = partials, torch.zeros(tiles, dtype=torch.int32, device=device)
    return _split_buffers[device]


def dense_matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, with decode-sized inputs through the GEMV: on Qwen3-8B's projections it
    reads bf16 weights faster than cuBLAS (scripts/gemv_sweep.py), and as a Triton kernel
    it launches with PDL, so a layer's kernels all overlap their neighbours."""
    if dense_gemv and x.shape[0] <= GEMV_MAX_ROWS:
        return _gemv(x, weight, None, bias)
    return F.linear(x, weight, bias)


def int8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS:
        return _gemv(x, q, scales, bias)
    n, k = q.shape
    if rows <= DOT_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _int8_dot_tuned(rows)[_dot_grid(n)](
            x, q, scales, _optional_arg(x, bias), out, rows, n, x.stride(0), q.stride(0),
            scales.stride(0), out.stride(0), K=k, GROUP=k // scales.shape[1],
            HAS_BIAS=bias is not None, BLOCK_M=DOT_MAX_ROWS, **launch_options(x.device),
        )  # fmt: skip
        return out
    w = (q.view(n, scales.shape[1], -1).to(x.dtype) * scales.to(x.dtype)[..., None]).view(n, k)
    return F.linear(x, w, bias)


def int4_matmul(
    x: torch.Tensor,
    words: torch.Tensor,  # formats.pack_int4's layout
    scale_mins: torch.Tensor,  # bf16 [out, groups, 2]: each group's scale and min
    bias: torch.Tensor | None,
) -> torch.Tensor:
    n, groups, _ = scale_mins.shape
    k = words.shape[1] * 8
    rows = x.shape[0]
    group = k // groups
    if 2 <= rows <= INT4_MMA_MAX_ROWS and x.dtype == torch.bfloat16 and group == 128:
        x = x.contiguous()
        x = x if x.data_ptr() % 16 == 0 else x.clone()  # its rows load 16 bytes at a time
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _int4_mma_tuned(rows)[(triton.cdiv(n, 16),)](
            x, words, scale_mins, _optional_arg(x, bias), out, rows, n, x.stride(0),
            words.stride(0), scale_mins.stride(0), out.stride(0), K=k,
            HAS_BIAS=bias is not None, **launch_options(x.device),
        )  # fmt: skip
        return out
    if rows <= INT4_GEMV_MAX_ROWS:
        # The GEMVs load 16-bit inputs as 4-byte pairs: rows at an odd element are copied.
        x = x.contiguous() if x.data_ptr() % 4 == 0 else x.clone()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        tensors = x, words, scale_mins, _optional_arg(x, bias), out
        strides = x.stride(0), words.stride(0), scale_mins.stride(0), out.stride(0)
        shape = {"K": k, "GROUP": k // groups, "HAS_BIAS": bias is not None}
        if rows == 1:
            _int4_gemv_tuned(rows)[_per_row_grid(n, rows)](
                *tensors, n, *strides, **shape, **launch_options(x.device)
            )
        else:
            _int4_gemv_rows_tuned(rows)[(triton.cdiv(n, 4),)](
                *tensors, rows, n, *strides, **shape, ROWS=triton.next_power_of_2(rows),
                **launch_options(x.device),
            )  # fmt: skip
        return out
    if rows <= DOT_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _int4_dot_tuned(rows)[_dot_grid(n)](
            x, words, scale_mins, _optional_arg(x, bias), out, *split_buffers(x.device), rows, n,
            x.stride(0), words.stride(0), scale_mins.stride(0), out.stride(0), K=k,
            GROUP=k // groups, HAS_BIAS=bias is not None, BLOCK_M=DOT_MAX_ROWS,
            **launch_options(x.device),
        )  # fmt: skip
        return out
    q = unpack_int4(words, k // groups).view(n, groups, -1).to(x.dtype)
    sm = scale_mins.to(x.dtype)
    w = q * sm[..., :1] + sm[..., 1:]
    return F.linear(x, w.view(n, k), bias)


def fp8_matmul(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    n, k = q.shape
    rows = x.shape[0]
    if rows <= GEMV_MAX_ROWS:
        return _gemv(x, q, scales, bias)
    if rows <= DOT_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _fp8_dot_tuned(rows)[_dot_grid(n)](
            x, q, scales, _optional_arg(x, bias), out, *split_buffers(x.device), rows, n,
            x.stride(0), q.stride(0), out.stride(0), K=k, HAS_BIAS=bias is not None,
            BLOCK_M=DOT_MAX_ROWS, **launch_options(x.device),
        )  # fmt: skip
        return out
    return F.linear(x, q.to(x.dtype) * scales.to(x.dtype), bias)
