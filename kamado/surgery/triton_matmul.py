"""Matmuls over compressed weights on CUDA: Triton kernels for decode-sized inputs,
dequantize-then-cuBLAS for everything wider.

Decode reads every weight once per token, so its matmuls are bound by the bytes they read.
- int8 and fp8 weights at up to GEMV_MAX_ROWS input rows run a GEMV per row: it reads the
  bytes and their scales, widens them in registers and accumulates in float32. So does
  int4 at one row.
- int4 with bf16 inputs of two to INT4_MMA_MAX_ROWS rows (several agents decoding at
  once) takes mma.sync: each thread loads the words that its part of an MMA tile needs,
  widens them in registers and the tensor cores multiply them with all rows at once.
  Its groups are of 128 or (as GGUF's 4-bit types load) of 32 or 64. Other inputs (fp16,
  float32, other groups) take an int4 GEMV for up to INT4_GEMV_MAX_ROWS rows, which
  widens each word once for all rows.
- int4 weights beyond those, and int8 and fp8 from three rows, up to DOT_MAX_ROWS, go
  through tensor cores on tiles: each program widens its tile in registers (by bit
  tricks, not the int-to-float instruction, which Hopper issues at an eighth of the FMA
  rate) and reads it once for all input rows. int8 and fp8, with a scale per row or (int8,
  as GGUF's Q8_0 loads) per group, share one kernel, its tiles and their split of K.
- From DOT_MAX_ROWS up to TILED_MAX_ROWS rows (many agents decoding, or speculation's
  verify steps) the tile kernels run the rows in slices of DOT_MAX_ROWS: each slice reads
  the compressed weight again, and two slices still beat widening it.
- Wider inputs (prefill) are compute-bound: the weight is widened to the activation dtype
  once (widen.py) and cuBLAS does the product.
The int4 kernels are in int4_gemv and int4_tensor_cores; this module has the others, the
tile configurations the autotuner chooses among, and the choice of kernel per call.
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
from kamado.surgery.int4_gemv import int4_gemv_kernel, int4_gemv_rows_kernel
from kamado.surgery.int4_tensor_cores import int4_dot_kernel, int4_mma_kernel
from kamado.surgery.kernel_epilogues import (
    silu_mul,
    store_gated_row,
    store_row,
    store_tile,
    sum_splits,
    tile_sum,
)
from kamado.surgery.widen import widen_int4, widen_scaled

GEMV_MAX_ROWS = 2
# int4's GEMV for two to four input rows reads and widens each word once for all of them,
# faster than the tile kernel there (scripts/gemv_sweep.py 2 int4 against dot_sweep.py 2
# int4); it serves what int4_mma_kernel does not take.
INT4_GEMV_MAX_ROWS = 4
# int4 with bf16 inputs from two rows to this many (the columns of one MMA) takes
# int4_mma_kernel; at one row the GEMV reads 4 of Qwen3-8B's 5 shapes faster
# (scripts/gemv_sweep.py 1 int4 against 1 int4-mma).
INT4_MMA_MAX_ROWS = 8
DOT_MAX_ROWS = 16  # input rows of the tensor-core kernels (one MMA tile)
# Inputs up to this many rows run as slices of DOT_MAX_ROWS, each slice reading the
# compressed weight; wider ones are widened (widen.py: the weight read once, written at 2
# bytes a value and read back by cuBLAS). On an H100 at Qwen3-8B's shapes, two slices (32
# rows) beat widening in every format and shape, by 1.2x to 2.7x; four (64 rows) lost on 3
# of the 5 shapes for int8 and fp8 and on 4 for int4 (`scripts/gemv_bandwidth.py ROWS
# --model qwen3-8b --tiled-max-rows 16` against 64, at 32 and 64 rows:
# bench/results/2026-12-07-h100-row-slices-and-widening.txt).
TILED_MAX_ROWS = 32
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
    for bn, g, w in [(4, 32, 4), (8, 16, 4), (8, 16, 2), (4, 8, 1), (8, 8, 2), (4, 4, 1)]
]
# A one-row int4 GEMV program has one step of its rows' weights in flight at a time, so a
# matrix of few rows needs long steps to keep DRAM busy (whose bandwidth times latency is
# about 3-4 TB/s x ~0.8 us, some 20-25 KB per SM on 132 SMs). Each tile must offer at
# least this many bytes per SM in one step of all the matrix's rows. The bound sits where
# the sweeps on an H100 and an H200 split the tiles (scripts/gemv_sweep.py 1 int4): at
# 4096-6144 rows, the tiles it drops read at half the rate of those it keeps in a decode
# step's chain of kernels. Triton's autotuner times each call alone and sometimes picked
# one of them: on an H100 that pick for Qwen3-8B's QKV cost 4% of int4's decode rate in
# one run of two (bench/results/2026-12-06-h100-int4-gemv-tuner-choice.txt).
INT4_GEMV_MIN_BYTES_IN_FLIGHT = 24 * 1024
HOPPER_SMS = 132  # the H100's and H200's multiprocessors
# Two to four input rows, four weight rows a program: (GROUPS_PER_STEP, num_warps), the
# winners of scripts/gemv_sweep.py 2 int4 and 4 int4.
_INT4_GEMV_ROWS_CONFIGS = [
    triton.Config({"GROUPS_PER_STEP": g}, num_warps=w)
    for g, w in [(4, 1), (8, 1), (8, 2), (16, 2), (32, 2), (32, 4)]
]
# (warps, STAGES) of an int4_mma_kernel program: the winners of scripts/gemv_sweep.py 1
# int4-mma and 4 int4-mma among 2-16 warps and 1-4 stages.
_INT4_MMA_CONFIGS = [
    triton.Config({"WARPS": w, "STAGES": s}, num_warps=w)
    for w, s in [(2, 1), (4, 1), (8, 1), (8, 4)]
]
SPLIT_MAX_OUT = 16384  # output rows up to which an int4 matmul may split its inputs
_SPLIT_MAX = 8  # the most SPLIT_K above
# int8 and fp8 on tensor cores (_scaled_dot_kernel), a scale per row or per group alike.
_SCALED_DOT_CONFIGS = [
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
def _add_products(acc, w, x, STEP_SUMS: tl.constexpr):
    """A GEMV step's float32 products of weight rows w [rows, BLOCK_K] and inputs x added
    to acc: summed along K at once (STEP_SUMS), else kept per tile value."""
    products = w.to(tl.float32) * x[None, :]
    return acc + (tl.sum(products, axis=1, keep_dims=True) if STEP_SUMS else products)


@triton.jit
def _rowwise_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, partial_ptr, arrived_ptr, N, stride_xm, stride_wn,
    stride_sn, stride_om, K: tl.constexpr, GROUP: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, STEP_SUMS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[m, rows] = (x[m] @ q[rows].T) * scale[rows]: int8 or fp8 values, a scale per row
    (GROUP = K); int8 with a scale per group of GROUP inputs (as GGUF's Q8_0 and Q5_0 load),
    each step's products then summed per group, scaled and kept per group; or bf16/fp16
    weights as they are, without scales (dense_matmul).

    Rows past N are clamped to the last row (read, never stored) so weight loads need no
    mask when BLOCK_K divides K; pointers advance by BLOCK_K instead of being recomputed.
    SPLIT_K programs share a tile's inputs, as in int4_dot_kernel (see sum_splits).
    STEP_SUMS sums each tile's products along K at once, keeping a float32 per row rather
    than one per tile value: a tile may then be as wide as K, so that each thread's loads
    of a whole row slice are in flight together (a GEMV of a small matrix waits on memory
    latency, not bandwidth, when each thread has only a load or two out).
    GATED: the weight is an MLP's gate rows then its up rows, N of each, and the output is
    silu(gate) * up, [m, N]: each program reads its rows of both (more loads in flight)
    and the SiLU needs no kernel of its own. Not split (sum_splits sums one tile), nor
    grouped."""
    GROUPED: tl.constexpr = HAS_SCALE and GROUP < K
    STEP_GROUPS: tl.constexpr = BLOCK_K // GROUP if GROUPED else 1
    tl.static_assert(SPLIT_K == 1 or not GATED)
    tl.static_assert(not (GROUPED and GATED))
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
    up_rows = N * stride_wn if GATED else 0  # the up rows' offset from the gate rows'
    group_steps = tl.arange(0, STEP_GROUPS)  # GROUPED: a step's groups
    s_ptrs = s_ptr + rows64[:, None] * stride_sn + first // GROUP + group_steps[None, :]
    ACC_WIDTH: tl.constexpr = STEP_GROUPS if GROUPED else (1 if STEP_SUMS else BLOCK_K)
    acc = tl.zeros([BLOCK_N, ACC_WIDTH], tl.float32)
    up_acc = tl.zeros([BLOCK_N, ACC_WIDTH], tl.float32)  # GATED only
    for k0 in range(first, tl.minimum(first + K_SPLIT, K), BLOCK_K):
        if K % BLOCK_K == 0:
            x = tl.load(x_ptrs).to(tl.float32)
            w = tl.load(w_ptrs)
            w_up = tl.load(w_ptrs + up_rows) if GATED else w
        else:
            kmask = k0 + ks < K
            x = tl.load(x_ptrs, mask=kmask, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)
            w_up = tl.load(w_ptrs + up_rows, mask=kmask[None, :], other=0.0) if GATED else w
        if GROUPED:
            in_k = k0 // GROUP + group_steps < K // GROUP  # all but in a last, partial step
            scales = tl.load(s_ptrs, mask=in_k[None, :], other=0.0)
            products = tl.reshape(w.to(tl.float32) * x[None, :], [BLOCK_N, STEP_GROUPS, GROUP])
            acc += tl.sum(products, axis=2) * scales.to(tl.float32)
            s_ptrs += STEP_GROUPS
        else:
            acc = _add_products(acc, w, x, STEP_SUMS)
        if GATED:
            up_acc = _add_products(up_acc, w_up, x, STEP_SUMS)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = tl.sum(acc, axis=1)
    if GATED:
        up = tl.sum(up_acc, axis=1)
        if HAS_SCALE:
            out *= tl.load(s_ptr + rows64).to(tl.float32)
            up *= tl.load(s_ptr + N + rows64).to(tl.float32)
        store_gated_row(out, up, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)
    else:
        last = True
        if SPLIT_K > 1:
            tile = m * tl.num_programs(0) + tl.program_id(0)
            out, last = sum_splits(
                out, tl.arange(0, BLOCK_N), partial_ptr, arrived_ptr, tile, split, BLOCK_N,
                SPLIT_K,
            )  # fmt: skip
        if last:
            if HAS_SCALE and not GROUPED:
                out *= tl.load(s_ptr + rows64).to(tl.float32)
            store_row(out, b_ptr, out_ptr + m * stride_om, rows, rows64, N, HAS_BIAS)


@triton.jit
def _tensor_core_operands(x, w):
    """A tile's inputs and weights as the tensor cores take them, both exact: int8 in the
    inputs' dtype (to bf16 Triton widens by a bit trick; to fp16 it would take the
    int-to-float instruction, which Hopper issues at an eighth of the FMA rate); e4m3 in
    fp16, with the inputs rounded to fp16 (three more mantissa bits than bf16) and clamped
    to its range."""
    if w.dtype == tl.int8:
        w = w.to(x.dtype)
    else:
        x = tl.clamp(x.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        w = w.to(tl.float16)
    return x, w


@triton.jit
def _scaled_dot_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, partial_ptr, arrived_ptr, M, N, stride_xm, stride_wn,
    stride_sn, stride_om, K: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, SWAP: tl.constexpr,
    SPLIT_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[:M, rows] = x @ (q * scale)[rows].T on tensor cores, for int8 or e4m3 q with a
    scale per row (GROUP = K), or int8 with a scale per GROUP inputs (K a multiple of it):
    q exact in the operands' dtype (_tensor_core_operands), products summed in float32.
    A row's scale multiplies its sum once, at the end; a group's multiplies that group's
    product, each step's BLOCK_K // GROUP groups unrolled so that their loads are in flight
    together. Input rows past M are zeros. SWAP and SPLIT_K as in int4_dot_kernel: the
    weights on the left of the product, read by the tensor cores from registers; programs
    that share a tile's inputs (see sum_splits)."""
    let_next_start(PDL)
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.arange(0, BLOCK_M)
    GROUPED: tl.constexpr = GROUP < K
    TILE: tl.constexpr = GROUP if GROUPED and GROUP < BLOCK_K else BLOCK_K  # one product's K
    ks = tl.arange(0, TILE)
    K_SPLIT: tl.constexpr = (K + BLOCK_K * SPLIT_K - 1) // (BLOCK_K * SPLIT_K) * BLOCK_K
    first = split * K_SPLIT
    end = tl.minimum(first + K_SPLIT, K)
    w_ptrs = w_ptr + rows64[:, None] * stride_wn + first + ks[None, :]
    x_ptrs = x_ptr + ms[:, None] * stride_xm + first + ks[None, :]
    s_row = s_ptr + rows64 * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP else [BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(first, end, BLOCK_K):
        for j in tl.static_range(BLOCK_K // TILE):
            if K % BLOCK_K == 0:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs, mask=(ms < M)[:, None], other=0.0)
            else:  # a last, partial step
                kmask = k0 + j * TILE + ks < end
                w = tl.load(w_ptrs, mask=kmask[None, :], other=0.0)  # cast to int8 or e4m3
                x = tl.load(x_ptrs, mask=(ms < M)[:, None] & kmask[None, :], other=0.0)
            x, w = _tensor_core_operands(x, w)
            if GROUPED:
                at = tl.minimum(k0 + j * TILE, K - 1) // GROUP  # past K: a product of zeros
                scale = tl.load(s_row + at).to(tl.float32)
                if SWAP:
                    acc += tl.dot(w, tl.trans(x)) * scale[:, None]
                else:
                    acc += tl.dot(x, tl.trans(w)) * scale[None, :]
            else:
                acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
            w_ptrs += TILE
            x_ptrs += TILE
    acc, last = tile_sum(
        acc, ms, partial_ptr, arrived_ptr, tile, split, BLOCK_N, BLOCK_M, SWAP, SPLIT_K
    )
    if last:
        if not GROUPED:
            acc *= tl.load(s_row).to(tl.float32)[None, :]
        store_tile(acc, b_ptr, out_ptr, ms, rows, rows64, M, N, stride_om, HAS_BIAS)


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
    """Configurations that split K only for matrices of few enough rows (and not gated)."""
    splits = named_args["N"] <= SPLIT_MAX_OUT and not kwargs.get("GATED", False)
    return [c for c in configs if c.kwargs["SPLIT_K"] == 1 or splits]


def _gemv_fits(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """_split_fits' configurations whose steps are whole groups, for a scale per group."""
    group = kwargs["GROUP"]
    return [
        c
        for c in _split_fits(configs, named_args, **kwargs)
        if group == kwargs["K"] or c.kwargs["BLOCK_K"] % group == 0
    ]


def int4_gemv_configs(
    configs: list[triton.Config], weight_rows: int, group: int, multiprocessors: int
) -> list[triton.Config]:
    """The one-row int4 GEMV tiles whose step over all `weight_rows` (GROUPS_PER_STEP
    groups of each) is INT4_GEMV_MIN_BYTES_IN_FLIGHT per multiprocessor or more; the
    longest-step ones where none is."""

    def in_flight(config: triton.Config) -> float:
        step_bytes = config.kwargs["GROUPS_PER_STEP"] * group // 2
        return weight_rows * step_bytes / multiprocessors

    enough = [c for c in configs if in_flight(c) >= INT4_GEMV_MIN_BYTES_IN_FLIGHT]
    most = max(in_flight(c) for c in configs)
    return enough or [c for c in configs if in_flight(c) == most]


def _int4_gemv_fits(
    configs: list[triton.Config], named_args: dict, **kwargs
) -> list[triton.Config]:
    weight_rows = named_args["N"] * (2 if kwargs["GATED"] else 1)
    device = named_args["w_ptr"].device
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else HOPPER_SMS  # compiled ahead for Hopper without a GPU (tests/kernels)
    )
    return int4_gemv_configs(configs, weight_rows, kwargs["GROUP"], sms)


_rowwise_tuned = _tuned_per_rows(
    _rowwise_kernel, _CONFIGS, key=["N", "K", "GROUP", "GATED"],
    prune_configs_by={"early_config_prune": _gemv_fits},
)  # fmt: skip
_int4_dot_tuned = _tuned_per_rows(
    int4_dot_kernel, _INT4_DOT_CONFIGS, key=["N", "K", "GROUP"],
    prune_configs_by={"early_config_prune": _split_fits},
)  # fmt: skip
_int4_gemv_tuned = _tuned_per_rows(
    int4_gemv_kernel, _INT4_GEMV_CONFIGS, key=["N", "K", "GROUP", "GATED"],
    prune_configs_by={"early_config_prune": _int4_gemv_fits},
)  # fmt: skip
_int4_mma_tuned = _tuned_per_rows(int4_mma_kernel, _INT4_MMA_CONFIGS, key=["N", "K", "GROUP"])
_int4_gemv_rows_tuned = _tuned_per_rows(
    int4_gemv_rows_kernel, _INT4_GEMV_ROWS_CONFIGS, key=["N", "K", "GROUP"]
)
_scaled_dot_tuned = _tuned_per_rows(
    _scaled_dot_kernel, _SCALED_DOT_CONFIGS, key=["N", "K", "GROUP"],
    prune_configs_by={"early_config_prune": _split_fits},
)  # fmt: skip


def _per_row_grid(n: int, rows: int) -> Callable[[dict], tuple[int, int, int]]:
    return lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), rows, meta.get("SPLIT_K", 1))


def _optional_arg(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor:
    """t, or x in its place where t is None: the kernel's flag for it (HAS_BIAS, HAS_SCALE)
    is then off, and the pointer is never read."""
    return t if t is not None else x


def _gemv(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    gated: bool = False,
) -> torch.Tensor:
    """int8 or fp8 rows with a scale per row or per group, or bf16/fp16 rows (no scales).
    gated (no groups): q is gate rows then up rows, and the result silu(gate) * up."""
    x = x.contiguous()
    n, k = q.shape
    if gated:
        n //= 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    grid = _per_row_grid(n, x.shape[0])
    groups = 1 if scales is None else scales.shape[1]
    assert groups == 1 or not gated, "the GEMV with a scale per group has no gated form"
    _rowwise_tuned(x.shape[0])[grid](
        x, q, _optional_arg(x, scales), _optional_arg(x, bias), out, *split_buffers(x.device),
        n, x.stride(0), q.stride(0), 0 if scales is None else scales.stride(0), out.stride(0),
        K=k, GROUP=k // groups, HAS_SCALE=scales is not None, HAS_BIAS=bias is not None,
        GATED=gated, **launch_options(x.device),
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


def _takes_gemv(rows: int, scales: torch.Tensor | None) -> bool:
    """Whether a matmul of `rows` input rows over a weight with these scales (None: a
    dense weight; else int8 or fp8's) runs the GEMV."""
    return rows <= GEMV_MAX_ROWS and (scales is not None or dense_gemv)


def _silu_mul_if(gated: bool, out: torch.Tensor) -> torch.Tensor:
    """A matmul's output, or for a gated call (of a kernel without a gated form) the SiLU
    product of its gate and up halves."""
    return silu_mul(out) if gated else out


# Every matmul below takes `gated`: the weight is an MLP's fused gate/up projection (gate's
# rows, then up's) and the result silu(gate) * up, in the GEMV's epilogue where a GEMV runs
# (one kernel, not two), else by silu_mul after the matmul.


def dense_matmul(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False
) -> torch.Tensor:
    """F.linear, with decode-sized inputs through the GEMV: on Qwen3-8B's projections it
    reads bf16 weights faster than cuBLAS (scripts/gemv_sweep.py), and as a Triton kernel
    it launches with PDL, so a layer's kernels all overlap their neighbours."""
    if _takes_gemv(x.shape[0], None):
        return _gemv(x, weight, None, bias, gated)
    return _silu_mul_if(gated, F.linear(x, weight, bias))


def scaled_matmul(
    x: torch.Tensor,
    q: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool = False,
) -> torch.Tensor:
    """int8 weights with a scale per row or per group, or fp8 with a scale per row: every
    kernel below takes either format, so the choice of kernel is one."""
    scales = scales.contiguous()  # the kernels read a row's scales side by side
    if gated and _takes_gemv(x.shape[0], scales) and scales.shape[1] == 1:
        return _gemv(x, q, scales, bias, gated=True)
    return _silu_mul_if(gated, _scaled_product(x, q, scales, bias))


int8_matmul = fp8_matmul = scaled_matmul


def _in_row_slices(
    product: Callable[..., torch.Tensor], x: torch.Tensor, *weight: torch.Tensor | None
) -> torch.Tensor:
    """product(x, *weight) computed on slices of x's rows of DOT_MAX_ROWS each, so that each
    runs in a kernel that reads the compressed weight; the last slice may be shorter."""
    slices = [product(x[i : i + DOT_MAX_ROWS], *weight) for i in range(0, x.shape[0], DOT_MAX_ROWS)]
    return torch.cat(slices)


def _scaled_product(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    rows = x.shape[0]
    if DOT_MAX_ROWS < rows <= TILED_MAX_ROWS:
        return _in_row_slices(_scaled_product, x, q, scales, bias)
    if _takes_gemv(rows, scales):
        return _gemv(x, q, scales, bias)
    if rows <= DOT_MAX_ROWS:
        return _scaled_dot(x, q, scales, bias)
    return F.linear(x, widen_scaled(q, scales, x.dtype), bias)


def _scaled_dot(
    x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """int8 or fp8 weights with a scale per row or per group, at up to DOT_MAX_ROWS input
    rows."""
    x = x.contiguous()
    rows, n, k = x.shape[0], q.shape[0], q.shape[1]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    _scaled_dot_tuned(rows)[_dot_grid(n)](
        x, q, scales, _optional_arg(x, bias), out, *split_buffers(x.device), rows, n,
        x.stride(0), q.stride(0), scales.stride(0), out.stride(0), K=k,
        GROUP=k // scales.shape[1], HAS_BIAS=bias is not None, BLOCK_M=DOT_MAX_ROWS,
        **launch_options(x.device),
    )  # fmt: skip
    return out


def _rows_aligned(x: torch.Tensor, alignment: int) -> torch.Tensor:
    """x contiguous, copied where its first row does not start at a multiple of
    `alignment` bytes (a view at an odd element, say); its other rows follow, as K is a
    multiple of the group."""
    x = x.contiguous()
    return x if x.data_ptr() % alignment == 0 else x.clone()


def int4_matmul(
    x: torch.Tensor,
    words: torch.Tensor,  # formats.pack_int4's layout
    scale_mins: torch.Tensor,  # bf16 [out, groups, 2]: each group's scale and min
    bias: torch.Tensor | None,
    gated: bool = False,
) -> torch.Tensor:
    if gated and x.shape[0] == 1:
        return _int4_gemv(x, words, scale_mins, bias, gated=True)
    return _silu_mul_if(gated, _int4_product(x, words, scale_mins, bias))


def _int4_gemv(
    x: torch.Tensor,
    words: torch.Tensor,
    scale_mins: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool = False,
) -> torch.Tensor:
    """One to INT4_GEMV_MAX_ROWS input rows on CUDA cores; gated at one row only."""
    n, groups, _ = scale_mins.shape
    k = words.shape[1] * 8
    rows = x.shape[0]
    outputs = n // 2 if gated else n
    x = _rows_aligned(x, 4)  # the GEMVs load 16-bit inputs as 4-byte pairs
    out = torch.empty(rows, outputs, dtype=x.dtype, device=x.device)
    tensors = x, words, scale_mins, _optional_arg(x, bias), out
    strides = x.stride(0), words.stride(0), scale_mins.stride(0), out.stride(0)
    shape = {"K": k, "GROUP": k // groups, "HAS_BIAS": bias is not None}
    if rows == 1:  # the grid covers the weight's rows, gated or not
        _int4_gemv_tuned(rows)[_per_row_grid(n, rows)](
            *tensors, outputs, *strides, **shape, GATED=gated,
            **launch_options(x.device),
        )  # fmt: skip
    else:
        assert not gated, "the int4 GEMV of several rows has no gated form"
        _int4_gemv_rows_tuned(rows)[(triton.cdiv(n, 4),)](
            *tensors, rows, n, *strides, **shape, ROWS=triton.next_power_of_2(rows),
            **launch_options(x.device),
        )  # fmt: skip
    return out


def _mma_takes(group: int, k: int) -> bool:
    """Whether int4_mma_kernel takes this group and K: it steps through blocks of 128
    inputs, a lane's four words one group's."""
    return group in (32, 64, 128) and k % 128 == 0


def _int4_product(
    x: torch.Tensor, words: torch.Tensor, scale_mins: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    n, groups, _ = scale_mins.shape
    k = words.shape[1] * 8
    rows = x.shape[0]
    group = k // groups
    if DOT_MAX_ROWS < rows <= TILED_MAX_ROWS:
        return _in_row_slices(_int4_product, x, words, scale_mins, bias)
    if 2 <= rows <= INT4_MMA_MAX_ROWS and x.dtype == torch.bfloat16 and _mma_takes(group, k):
        x = _rows_aligned(x, 16)  # its rows load 16 bytes at a time
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _int4_mma_tuned(rows)[(triton.cdiv(n, 16),)](
            x, words, scale_mins, _optional_arg(x, bias), out, rows, n, x.stride(0),
            words.stride(0), scale_mins.stride(0), out.stride(0), K=k, GROUP=group,
            HAS_BIAS=bias is not None, **launch_options(x.device),
        )  # fmt: skip
        return out
    if rows <= INT4_GEMV_MAX_ROWS:
        return _int4_gemv(x, words, scale_mins, bias)
    if rows <= DOT_MAX_ROWS:
        x = x.contiguous()
        out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
        _int4_dot_tuned(rows)[_dot_grid(n)](
            x, words, scale_mins, _optional_arg(x, bias), out, *split_buffers(x.device), rows, n,
            x.stride(0), words.stride(0), scale_mins.stride(0), out.stride(0), K=k,
            GROUP=group, HAS_BIAS=bias is not None, BLOCK_M=DOT_MAX_ROWS,
            **launch_options(x.device),
        )  # fmt: skip
        return out
    return F.linear(x, widen_int4(words, scale_mins, x.dtype), bias)
