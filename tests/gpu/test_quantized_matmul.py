"""Compressed linears on CUDA (Triton GEMVs for 1-2 rows of int8 and fp8 and 1-4 of int4,
int4 on mma.sync for 2-8 bf16 rows, tensor-core kernels for up to 16 input rows and in
slices of 16 up to 32, widened for cuBLAS beyond) against x @ W.T
with W dequantized from the same compressed tensors in float32; and dense_matmul (the same
GEMV on bf16 weights) against the float32 product."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
triton = pytest.importorskip("triton")

from kamado.pdl import launch_options  # noqa: E402
from kamado.surgery import formats, int4_gemv, int4_tensor_cores  # noqa: E402
from kamado.surgery import triton_matmul as tm  # noqa: E402
from kamado.surgery.qlinear import Fp8Linear, Int4Linear, Int8Linear  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
# bf16 activations and output: each input and the result round at 2^-9 relative.
TOLERANCE = 1e-2
SHAPES = [(1000, 512), (4096, 12288)]


def relative_error(module: torch.nn.Module, reference_w: torch.Tensor, rows: int) -> float:
    k = reference_w.shape[1]
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    expected = x.float() @ reference_w.T
    if module.bias is not None:
        expected += module.bias.float()
    got = module(x).float()
    assert got.shape == expected.shape and module(x).dtype == torch.bfloat16
    return float((got - expected).norm() / expected.norm())


def weight(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, device=CUDA) * 0.02


def int4_on_card(q: torch.Tensor, module: Int4Linear) -> torch.Tensor:
    """The weight an Int4Linear's kernels compute with: q with the scales and mins as the
    card holds them (bf16), whose rounding alone moved outputs by up to 0.9% against
    fp16 scales, close to TOLERANCE."""
    scale_mins = module.scale_mins.float()
    return formats.dequantize_int4(q, scale_mins[..., 0], scale_mins[..., 1])


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 9, 16, 17, 32, 65])
@pytest.mark.parametrize("group", [None, 32])
def test_int8_matmul_matches_its_dequantized_weight(n, k, rows, group):
    q, scales = formats.quantize_int8(weight(n, k), group)
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    module = Int8Linear(q, scales, bias)
    assert relative_error(module, formats.dequantize_int8(q, scales), rows) < TOLERANCE


@pytest.mark.parametrize("n,k", [*SHAPES, (1001, 896)])  # 896: 7 groups, a partial step
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8, 9, 16, 17, 32, 65])
@pytest.mark.parametrize("group,scale_dtype", [(128, torch.float16), (32, torch.float32)])
def test_int4_matmul_matches_its_dequantized_weight(n, k, rows, group, scale_dtype):
    q, scales, mins = formats.quantize_int4(weight(n, k), group, scale_dtype)
    module = Int4Linear(q, scales, mins, None)
    packed = module.packed
    assert packed.numel() * packed.element_size() == n * k // 2  # two values a byte on the card
    assert relative_error(module, int4_on_card(q, module), rows) < TOLERANCE


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
def test_int4_matmul_reads_each_input_dtype_and_an_unaligned_row(dtype, rows):
    """The GEMVs load 16-bit inputs two at a time: fp16 widens differently from bf16, fp32
    loads singly; the mma.sync kernel (bf16, three rows) loads 16 bytes at a time; rows
    starting at an odd element are copied before they are read."""
    n, k = 1000, 896
    q, scales, mins = formats.quantize_int4(weight(n, k), 128)
    module = Int4Linear(q, scales, mins, None)
    reference = int4_on_card(q, module)
    buffer = torch.randn(rows * k + 1, device=CUDA, dtype=dtype)
    for x in (buffer[: rows * k].view(rows, k), buffer[1:].view(rows, k)):
        expected = x.float() @ reference.T
        got = module(x)
        assert got.dtype == dtype
        assert float((got.float() - expected).norm() / expected.norm()) < TOLERANCE


needs_fp8 = pytest.mark.skipif(torch.cuda.get_device_capability() < (8, 9), reason="needs fp8")


@needs_fp8
@pytest.mark.parametrize("n,k", [*SHAPES, (20000, 896)])  # 896: no BLOCK_K divides it
@pytest.mark.parametrize("rows", [1, 2, 9, 17, 32, 65])
def test_fp8_matmul_matches_its_dequantized_weight(n, k, rows):
    q, scales = formats.quantize_fp8(weight(n, k))
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    module = Fp8Linear(q, scales, bias)
    assert relative_error(module, formats.dequantize_fp8(q, scales), rows) < TOLERANCE


@needs_fp8
def test_fp8_tensor_core_path_keeps_large_inputs_finite():
    """Its inputs round to fp16; values past fp16's range are clamped, not made infinite."""
    q, scales = formats.quantize_fp8(weight(20000, 512))
    x = torch.randn(3, 512, device=CUDA, dtype=torch.bfloat16)  # 3 rows: tensor cores
    x[0, 7] = 1e6
    assert torch.isfinite(Fp8Linear(q, scales, None)(x)).all()


def matches_and_repeats(run, x: torch.Tensor, reference_w: torch.Tensor, bias: torch.Tensor):
    """A kernel call `run()` gives x @ reference_w.T + bias within TOLERANCE, and the same
    bits on a second call (split-K arrival counts are back at zero, and partial sums are
    added in a fixed order)."""
    first, second = run(), run()
    expected = x.float() @ reference_w.T + bias.float()
    assert float((first.float() - expected).norm() / expected.norm()) < TOLERANCE
    assert torch.equal(first, second)


def outputs_storing_no_padding(
    launch: Callable[[torch.Tensor], None], rows: int, n: int
) -> torch.Tensor:
    """launch(out) into an output with a row more than the inputs: that row must stay as
    it was (a kernel whose inputs are padded must not store the padding); the others."""
    out = torch.full((rows + 1, n), 7.0, device=CUDA, dtype=torch.bfloat16)
    launch(out)
    assert (out[rows] == 7.0).all()
    return out[:rows]


@pytest.mark.parametrize("config", tm._INT4_DOT_CONFIGS, ids=str)
def test_every_int4_tile_configuration_matches_and_repeats_bit_for_bit(config):
    """Each configuration the autotuner may pick, split-K ones included."""
    n, k, rows = 3000, 896, 3  # 7 groups of 128: splits of unequal size, a partial step
    q, scales, mins = formats.quantize_int4(weight(n, k), 128)
    module = Int4Linear(q, scales, mins, torch.randn(n, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        out = torch.empty(rows, n, device=CUDA, dtype=torch.bfloat16)
        meta = dict(config.kwargs)
        grid = (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])
        int4_tensor_cores.int4_dot_kernel[grid](
            x, module.packed, module.scale_mins, module.bias, out, *tm.split_buffers(x.device),
            rows, n, x.stride(0), module.packed.stride(0), module.scale_mins.stride(0),
            out.stride(0), K=k, GROUP=128, HAS_BIAS=True, BLOCK_M=tm.DOT_MAX_ROWS, **meta,
            num_warps=config.num_warps, num_stages=config.num_stages, **launch_options(CUDA),
        )  # fmt: skip
        return out

    matches_and_repeats(run, x, int4_on_card(q, module), module.bias)


@pytest.mark.parametrize("config", tm._INT4_GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize("group", [128, 32])
def test_every_int4_gemv_configuration_matches_and_repeats_bit_for_bit(config, group):
    """The int4 GEMV (one row in int4_matmul; two here, so each program's row counts) in
    each configuration the autotuner may pick."""
    n, k, rows = 3000, 896, 2  # 7 groups of 128 (28 of 32): a partial last step
    q, scales, mins = formats.quantize_int4(weight(n, k), group)
    module = Int4Linear(q, scales, mins, torch.randn(n, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)

    matches_and_repeats(
        lambda: int4_gemv_run(config, x, module), x, int4_on_card(q, module), module.bias
    )


def int4_gemv_run(
    config: triton.Config, x: torch.Tensor, module: Int4Linear, gated: bool = False
) -> torch.Tensor:
    """int4_gemv_kernel in one configuration; gated: silu(gate) * up of the weight's two
    halves (the grid covers the weight's rows either way)."""
    n = module.out_features // 2 if gated else module.out_features
    out = torch.empty(x.shape[0], n, device=CUDA, dtype=torch.bfloat16)
    grid = (triton.cdiv(module.out_features, config.kwargs["BLOCK_N"]), x.shape[0])
    int4_gemv.int4_gemv_kernel[grid](
        x, module.packed, module.scale_mins, module.bias, out, n, x.stride(0),
        module.packed.stride(0), module.scale_mins.stride(0), out.stride(0),
        K=module.in_features, GROUP=module.group, HAS_BIAS=True, GATED=gated,
        **config.kwargs, num_warps=config.num_warps, **launch_options(CUDA),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("config", tm._INT4_GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize("group", [128, 32])
def test_gated_int4_gemv_is_the_gemv_then_silu_mul_bit_for_bit(config, group):
    """The int4 GEMV with SiLU(gate) * up as its epilogue against the plain one in the same
    configuration followed by silu_mul: the same bits (a gated program's quarters sum
    their rows as the plain one's do). 1501 outputs: the last program's rows pass N."""
    from kamado.surgery.kernel_epilogues import silu_mul

    n, k = 1501, 896
    q, scales, mins = formats.quantize_int4(weight(2 * n, k) * 3, group)
    module = Int4Linear(q, scales, mins, torch.randn(2 * n, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(2, k, device=CUDA, dtype=torch.bfloat16)
    fused = int4_gemv_run(config, x, module, gated=True)
    plain = silu_mul(int4_gemv_run(config, x, module))
    assert torch.equal(fused, plain)
    assert float(plain.float().std()) > 0.5


@pytest.mark.parametrize("config", tm._INT4_GEMV_ROWS_CONFIGS, ids=str)
@pytest.mark.parametrize("group", [128, 32])
@pytest.mark.parametrize("rows", [2, 3])
def test_every_int4_gemv_rows_configuration_matches_and_repeats_bit_for_bit(config, group, rows):
    """The int4 GEMV for two to four input rows in each configuration the autotuner may
    pick; three rows run as four, the fourth never stored, and 3001 outputs leave the last
    program three rows it only reads."""
    n, k = 3001, 896  # 7 groups of 128 (28 of 32): a partial last step
    q, scales, mins = formats.quantize_int4(weight(n, k), group)
    module = Int4Linear(q, scales, mins, torch.randn(n, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)

    def launch(out: torch.Tensor) -> None:
        int4_gemv.int4_gemv_rows_kernel[(triton.cdiv(n, 4),)](
            x, module.packed, module.scale_mins, module.bias, out, rows, n, x.stride(0),
            module.packed.stride(0), module.scale_mins.stride(0), out.stride(0), K=k,
            GROUP=group, HAS_BIAS=True, ROWS=triton.next_power_of_2(rows), **config.kwargs,
            num_warps=config.num_warps, **launch_options(CUDA),
        )  # fmt: skip

    def run() -> torch.Tensor:
        return outputs_storing_no_padding(launch, rows, n)

    matches_and_repeats(run, x, int4_on_card(q, module), module.bias)


@pytest.mark.parametrize("config", tm._INT4_MMA_CONFIGS, ids=str)
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("group", [128, 64, 32])
def test_every_int4_mma_configuration_matches_and_repeats_bit_for_bit(config, rows, group):
    """The int4 kernel on mma.sync in each configuration the autotuner may pick: up to 8
    input rows, 3001 outputs (the last tile part past N), 7 blocks of 128 inputs (not a
    multiple of any warp count: some warps' last blocks are past K), in groups of 128
    (scaled after the MMAs) and of 64 and 32 (GGUF's 4-bit types; scaled before)."""
    n, k = 3001, 896
    q, scales, mins = formats.quantize_int4(weight(n, k), group)
    module = Int4Linear(q, scales, mins, torch.randn(n, device=CUDA, dtype=torch.bfloat16))
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)

    def launch(out: torch.Tensor) -> None:
        int4_tensor_cores.int4_mma_kernel[(triton.cdiv(n, 16),)](
            x, module.packed, module.scale_mins, module.bias, out, rows, n, x.stride(0),
            module.packed.stride(0), module.scale_mins.stride(0), out.stride(0), K=k,
            GROUP=group, HAS_BIAS=True, **config.kwargs, num_warps=config.num_warps,
            **launch_options(CUDA),
        )  # fmt: skip

    def run() -> torch.Tensor:
        return outputs_storing_no_padding(launch, rows, n)

    matches_and_repeats(run, x, int4_on_card(q, module), module.bias)


@pytest.mark.parametrize("fmt", ["int8", "int8-g32", pytest.param("fp8", marks=needs_fp8)])
@pytest.mark.parametrize("config", tm._SCALED_DOT_CONFIGS, ids=str)
def test_every_scaled_tile_configuration_matches_and_repeats_bit_for_bit(config, fmt):
    """Each configuration the autotuner may pick for int8 and fp8 with a scale per row and
    int8 with a scale per 32 inputs, split-K ones included; int8 over every value it can
    hold, -128 too."""
    n, rows = 3000, 3
    k = 3008 if fmt == "int8-g32" else 3000  # a multiple of no BLOCK_K: partial steps
    if fmt == "fp8":
        q, scales = formats.quantize_fp8(weight(n, k))
        reference = formats.dequantize_fp8(q, scales)
        scales = scales.view(n, 1)
    else:
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=CUDA)
        scales = torch.rand(n, k // 32 if fmt == "int8-g32" else 1, device=CUDA) * 1e-3
        reference = formats.dequantize_int8(q, scales)
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)

    def run() -> torch.Tensor:
        out = torch.empty(rows, n, device=CUDA, dtype=torch.bfloat16)
        meta = dict(config.kwargs)
        tm._scaled_dot_kernel[(triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](
            x, q, scales, bias, out, *tm.split_buffers(x.device), rows, n, x.stride(0),
            q.stride(0), scales.stride(0), out.stride(0), K=k, GROUP=k // scales.shape[1],
            HAS_BIAS=True, BLOCK_M=tm.DOT_MAX_ROWS, **meta, num_warps=config.num_warps,
            num_stages=config.num_stages, **launch_options(CUDA),
        )  # fmt: skip
        return out

    matches_and_repeats(run, x, reference, bias)


@pytest.mark.parametrize("groups", [1, 16])  # a scale a row (rowwise), per 32 (grouped)
def test_int8_tensor_core_kernels_widen_every_byte_exactly(groups):
    """One-hot input rows read single weights back: with scales of 1 each output is a q,
    exact in bf16. Every byte value sits at every position within a word."""
    n, k, rows = 1024, 512, 16
    q = ((torch.arange(n)[:, None] + torch.arange(k)[None, :]) % 256 - 128).to(torch.int8)
    q = q.to(CUDA)
    columns = torch.tensor([0, 1, 2, 3, 4, 9, 14, 31, 64, 127, 130, 255, 257, 300, 450, 511])
    x = torch.zeros(rows, k, device=CUDA, dtype=torch.bfloat16)
    x[torch.arange(rows), columns.to(CUDA)] = 1.0
    out = tm.int8_matmul(x, q, torch.ones(n, groups, device=CUDA), None)
    assert torch.equal(out, q[:, columns.to(CUDA)].T.to(torch.bfloat16))


@pytest.mark.parametrize("n,k", [*SHAPES, (3000, 896)])
@pytest.mark.parametrize("rows", [1, 2, 3])  # 3: cuBLAS
@pytest.mark.parametrize("with_bias", [False, True])
def test_dense_matmul_matches_the_float32_product(n, k, rows, with_bias):
    w = weight(n, k).to(torch.bfloat16)
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16) if with_bias else None
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    got = tm.dense_matmul(x, w, bias)
    expected = x.float() @ w.float().T + (0 if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    assert float((got.float() - expected).norm() / expected.norm()) < TOLERANCE


def _bf16_unscaled(w: torch.Tensor) -> tuple[torch.Tensor, None]:
    return w.to(torch.bfloat16), None


GEMV_FORMATS = {
    "int8": (formats.quantize_int8, formats.dequantize_int8),
    "int8-g32": (lambda w: formats.quantize_int8(w, 32), formats.dequantize_int8),  # GGUF's
    "fp8": (formats.quantize_fp8, formats.dequantize_fp8),
    "bf16": (_bf16_unscaled, lambda q, _: q.float()),
}


def gemv(
    config: triton.Config, x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor | None,
    bias: torch.Tensor, gated: bool = False,
) -> torch.Tensor:  # fmt: skip
    """_rowwise_kernel in one configuration; gated: silu(gate) * up of q's two halves."""
    n = q.shape[0] // 2 if gated else q.shape[0]
    out = torch.empty(x.shape[0], n, device=CUDA, dtype=torch.bfloat16)
    meta = dict(config.kwargs)
    k = q.shape[1]
    groups = 1 if scales is None else scales.shape[1]
    tm._rowwise_kernel[(triton.cdiv(n, meta["BLOCK_N"]), x.shape[0], meta["SPLIT_K"])](
        x, q, tm._optional_arg(x, scales), bias, out, *tm.split_buffers(x.device), n,
        x.stride(0), q.stride(0), 0 if scales is None else scales.stride(0), out.stride(0),
        K=k, GROUP=k // groups, HAS_SCALE=scales is not None, HAS_BIAS=True, GATED=gated,
        **meta, num_warps=config.num_warps, **launch_options(CUDA),
    )  # fmt: skip
    return out


@pytest.mark.parametrize("config", tm._CONFIGS, ids=str)
@pytest.mark.parametrize("fmt", ["int8", "int8-g32", pytest.param("fp8", marks=needs_fp8), "bf16"])
def test_every_gemv_tile_configuration_matches_and_repeats_bit_for_bit(config, fmt):
    """The GEMV (int8/fp8 with a scale per row, int8 with one per group of 32, or bf16
    without) in each configuration the autotuner may pick: the same result as the
    dequantized weight, and the same bits on a second call."""
    n, k, rows = 3000, 3008, 2  # K a multiple of no BLOCK_K: partial steps, unequal splits
    quantize, dequantize = GEMV_FORMATS[fmt]
    q, scales = quantize(weight(n, k))
    bias = torch.randn(n, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    matches_and_repeats(lambda: gemv(config, x, q, scales, bias), x, dequantize(q, scales), bias)


@pytest.mark.parametrize("config", [c for c in tm._CONFIGS if c.kwargs["SPLIT_K"] == 1], ids=str)
@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8", marks=needs_fp8), "bf16"])
def test_gated_gemv_is_the_gemv_then_silu_mul_bit_for_bit(config, fmt):
    """The GEMV with SiLU(gate) * up as its epilogue, in each configuration the autotuner
    may pick for it: the same bits as the plain GEMV in that configuration followed by
    silu_mul (each program sums its rows as the plain one does, and rounds the gate and
    up outputs where the plain one stores them). 1500 outputs: the last program's rows
    pass N, and must neither be stored nor read from the up half."""
    from kamado.surgery.kernel_epilogues import silu_mul

    n, k, rows = 1500, 3000, 2
    quantize, _ = GEMV_FORMATS[fmt]
    q, scales = quantize(weight(2 * n, k) * 3)  # outputs of a few units: SiLU bends
    bias = torch.randn(2 * n, device=CUDA, dtype=torch.bfloat16)
    x = torch.randn(rows, k, device=CUDA, dtype=torch.bfloat16)
    fused = gemv(config, x, q, scales, bias, gated=True)
    plain = silu_mul(gemv(config, x, q, scales, bias))
    assert torch.equal(fused, plain)
    assert float(plain.float().std()) > 0.5
