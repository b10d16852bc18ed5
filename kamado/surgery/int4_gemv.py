"""int4 GEMVs on CUDA cores (Triton): one input row, and two to four rows whose inputs
the mma.sync kernel (int4_tensor_cores) does not take. Both read each word once, widen its
nibbles to float32 by a bit trick in inline PTX and accumulate in float32; the layout they
read is formats.pack_int4's. Dispatch and tuning: kamado.surgery.triton_matmul."""

from __future__ import annotations

import triton
import triton.language as tl

from kamado.pdl import let_next_start, wait_for_inputs
from kamado.surgery.formats import WORD_ORDER
from kamado.surgery.kernel_epilogues import store_gated_row, store_row


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
def _row_quarter(w_ptr, sm_ptr, start, shift, QUARTER: tl.constexpr, N, stride_wn, stride_sn,
                 words_at, gs):  # fmt: skip
    """One quarter of a GEMV program's weight rows, the QUARTER outputs from `start`, read
    `shift` rows on (a gated GEMV's up half): (the output rows, the output rows clamped in
    int64, pointers to their weight rows' words of a step, to their scales and mins)."""
    rows = start + tl.arange(0, QUARTER)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    w_rows = rows64 + shift
    w_ptrs = w_ptr + w_rows[:, None, None] * stride_wn + words_at[None, :, :]
    return rows, rows64, w_ptrs, sm_ptr + w_rows[:, None] * stride_sn + 2 * gs[None, :]


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
def _quarter_loads(w_ptrs, sm_ptrs, ok):
    """A step's words of one quarter's rows, and each word's group scale and min (bf16
    [rows, groups])."""
    words = tl.load(w_ptrs, mask=ok[None, :, None], other=0)
    scale = tl.load(sm_ptrs, mask=ok[None, :], other=0.0)
    return words, scale, tl.load(sm_ptrs + 1, mask=ok[None, :], other=0.0)


@triton.jit
def _step_loads(w0, w1, w2, w3, s0, s1, s2, s3, ok):
    """_quarter_loads of the four quarters of a GEMV program's rows."""
    return (
        _quarter_loads(w0, s0, ok), _quarter_loads(w1, s1, ok), _quarter_loads(w2, s2, ok),
        _quarter_loads(w3, s3, ok),
    )  # fmt: skip


@triton.jit
def _scale_offset(scale, low):
    """Each word's group scale and min - 128 * scale, float32 [rows, groups, 1]."""
    scale = scale.to(tl.float32)
    return scale[:, :, None], (low.to(tl.float32) - 128.0 * scale)[:, :, None]


@triton.jit
def _scaled(dots, scale, offset, word_sums):
    """Each word's part of its row's sum: scale * dot + (min - 128 * scale) * its inputs'
    sum, from the float32 bits `dots` of _int4_word_dot_asm (the others broadcast to it)."""
    return scale * dots.to(tl.float32, bitcast=True) + offset * word_sums


@triton.jit
def int4_gemv_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = x[m] @ w[rows].T on CUDA cores, w = q * scale + min (int4 words,
    scale and min per group in sm, bf16 [N, groups, 2]); x's rows start 4-byte aligned.
    GATED: w is an MLP's gate rows then its up rows, N of each, and out[m] is
    silu(gate) * up; a program's quarters are then two quarters of outputs' gate rows and
    the same outputs' up rows (BLOCK_N weight rows a program either way).

    - A word's inputs are four pairs (formats.pack_int4), each loaded in the words' own
      layout, so no value moves between threads until the end.
    - The program's rows are four quarters, and one asm (_int4_word_dot_asm) takes a word
      of each with the inputs widened once: x * (128 + q) for each. Then
      scale * that + (min - 128 * scale) * (the word's inputs summed) is the word's part
      of its row's sum. The subtraction costs float32 about four of its 24 bits, well
      under the bf16 rounding of the output.
    - A float32 per word of the tile accumulates across steps; only the last step sums
      across threads.
    - The first step's words, scales and mins load before the wait for x (kamado.pdl),
      so they are on their way while the kernel before finishes; each later step's load
      at the end of the step before. On the H200 this took the small projections from
      1.50-1.94 to 1.69-2.15 TB/s (scripts/gemv_sweep.py 1 int4)."""
    let_next_start(PDL)
    m = tl.program_id(1).to(tl.int64)
    QUARTER: tl.constexpr = BLOCK_N // 4
    first = tl.program_id(0) * (BLOCK_N // 2 if GATED else BLOCK_N)  # its first output
    up_first = first if GATED else first + 2 * QUARTER  # quarters 2 and 3's first output
    up_shift = N if GATED else 0
    WORDS: tl.constexpr = GROUP // 8
    NUM_GROUPS: tl.constexpr = K // GROUP
    gs = tl.arange(0, GROUPS_PER_STEP)
    words_at = gs[:, None] * WORDS + tl.arange(0, WORDS)[None, :]  # [groups, words] of a step
    r0, r0_64, w0, s0 = _row_quarter(
        w_ptr, sm_ptr, first, 0, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # fmt: skip
    r1, r1_64, w1, s1 = _row_quarter(
        w_ptr, sm_ptr, first + QUARTER, 0, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # fmt: skip
    r2, r2_64, w2, s2 = _row_quarter(
        w_ptr, sm_ptr, up_first, up_shift, QUARTER, N, stride_wn, stride_sn, words_at, gs
    )  # fmt: skip
    r3, r3_64, w3, s3 = _row_quarter(
        w_ptr, sm_ptr, up_first + QUARTER, up_shift, QUARTER, N, stride_wn, stride_sn,
        words_at, gs,
    )  # fmt: skip
    x_row = x_ptr + m * stride_xm
    # Each word's first pair; its others are WORDS, 2 WORDS and 3 WORDS pairs on.
    pairs_at = gs[:, None] * (GROUP // 2) + tl.arange(0, WORDS)[None, :]
    step = GROUPS_PER_STEP * WORDS  # words a row advances a step
    loaded = _step_loads(w0, w1, w2, w3, s0, s1, s2, s3, gs < NUM_GROUPS)
    wait_for_inputs(PDL)
    acc0 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc1 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc2 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    acc3 = tl.zeros([QUARTER, GROUPS_PER_STEP, WORDS], tl.float32)
    for g0 in range(0, NUM_GROUPS, GROUPS_PER_STEP):
        ok = g0 + gs < NUM_GROUPS  # False only in a last, partial step
        quarter0, quarter1, quarter2, quarter3 = loaded
        q0, sc0, lo0 = quarter0
        q1, sc1, lo1 = quarter1
        q2, sc2, lo2 = quarter2
        q3, sc3, lo3 = quarter3
        x0, x1, x2, x3, x4, x5, x6, x7, word_sums = _word_inputs(x_row, pairs_at, WORDS, ok)
        d0, d1, d2, d3 = tl.inline_asm_elementwise(
            _INT4_FOUR_WORDS_DOT, "=r,=r,=r,=r" + ",r" * 12,
            [q0, q1, q2, q3, _per_row(x0, q0), _per_row(x1, q0), _per_row(x2, q0),
             _per_row(x3, q0), _per_row(x4, q0), _per_row(x5, q0), _per_row(x6, q0),
             _per_row(x7, q0)],
            dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
        scale0, offset0 = _scale_offset(sc0, lo0)
        acc0 += _scaled(d0, scale0, offset0, word_sums[None, :, :])
        scale1, offset1 = _scale_offset(sc1, lo1)
        acc1 += _scaled(d1, scale1, offset1, word_sums[None, :, :])
        scale2, offset2 = _scale_offset(sc2, lo2)
        acc2 += _scaled(d2, scale2, offset2, word_sums[None, :, :])
        scale3, offset3 = _scale_offset(sc3, lo3)
        acc3 += _scaled(d3, scale3, offset3, word_sums[None, :, :])
        pairs_at += GROUPS_PER_STEP * (GROUP // 2)
        w0, w1, w2, w3 = w0 + step, w1 + step, w2 + step, w3 + step
        s0, s1 = s0 + 2 * GROUPS_PER_STEP, s1 + 2 * GROUPS_PER_STEP
        s2, s3 = s2 + 2 * GROUPS_PER_STEP, s3 + 2 * GROUPS_PER_STEP
        loaded = _step_loads(w0, w1, w2, w3, s0, s1, s2, s3, g0 + GROUPS_PER_STEP + gs < NUM_GROUPS)
    out_row = out_ptr + m * stride_om
    out0, out1 = tl.sum(tl.sum(acc0, axis=2), axis=1), tl.sum(tl.sum(acc1, axis=2), axis=1)
    out2, out3 = tl.sum(tl.sum(acc2, axis=2), axis=1), tl.sum(tl.sum(acc3, axis=2), axis=1)
    if GATED:
        store_gated_row(out0, out2, b_ptr, out_row, r0, r0_64, N, HAS_BIAS)
        store_gated_row(out1, out3, b_ptr, out_row, r1, r1_64, N, HAS_BIAS)
    else:
        store_row(out0, b_ptr, out_row, r0, r0_64, N, HAS_BIAS)
        store_row(out1, b_ptr, out_row, r1, r1_64, N, HAS_BIAS)
        store_row(out2, b_ptr, out_row, r2, r2_64, N, HAS_BIAS)
        store_row(out3, b_ptr, out_row, r3, r3_64, N, HAS_BIAS)


@triton.jit
def _row_start(w_ptr, sm_ptr, row, N, stride_wn, stride_sn):
    """Pointers to a weight row's first word and first scale (rows past N clamped to the
    last one: read, never stored)."""
    row64 = tl.minimum(row, N - 1).to(tl.int64)
    return w_ptr + row64 * stride_wn, sm_ptr + row64 * stride_sn


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
def int4_gemv_rows_kernel(
    x_ptr, w_ptr, sm_ptr, b_ptr, out_ptr, M, N, stride_xm, stride_wn, stride_sn, stride_om,
    K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    GROUPS_PER_STEP: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ w[rows].T for 2 <= M <= ROWS (2 or 4) input rows, on CUDA cores
    as int4_gemv_kernel for one, but each word is read and widened once for all input
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
    w0, s0 = _row_start(w_ptr, sm_ptr, first, N, stride_wn, stride_sn)
    w1, s1 = _row_start(w_ptr, sm_ptr, first + 1, N, stride_wn, stride_sn)
    w2, s2 = _row_start(w_ptr, sm_ptr, first + 2, N, stride_wn, stride_sn)
    w3, s3 = _row_start(w_ptr, sm_ptr, first + 3, N, stride_wn, stride_sn)
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
    store_row(out_a, b_ptr, out_ptr, rows, rows64, N, HAS_BIAS)
    out_b = _tile_sums(acc_b)
    store_row(out_b, b_ptr, out_ptr + stride_om, rows, rows64, N, HAS_BIAS)
    if ROWS == 4:  # an input row past M stores no output row (a count of 0)
        out_c = _tile_sums(acc_c)
        store_row(
            out_c, b_ptr, out_ptr + 2 * stride_om, rows, rows64, tl.where(M > 2, N, 0), HAS_BIAS
        )
        out_d = _tile_sums(acc_d)
        store_row(
            out_d, b_ptr, out_ptr + 3 * stride_om, rows, rows64, tl.where(M > 3, N, 0), HAS_BIAS
        )
