"""widen.py's kernels, run by Triton's interpreter on the CPU: each widened value must be
exactly the float32 value that formats' dequantization gives. The output is float32 here,
as the interpreter rounds to bf16 by truncation where the GPU rounds to nearest; the bf16
results are compared on the GPU (tests/gpu/test_quantized_matmul.py, 65 rows)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kamado.surgery import formats, widen  # noqa: E402

ROWS = 37  # two programs of BLOCK_ROWS and part of a third


@pytest.mark.parametrize("group", [32, 96, 128])  # 96: twelve words, a block of sixteen
def test_int4_widens_to_its_dequantized_values(interpreted_widen, group):
    q, scales, mins = formats.quantize_int4(torch.randn(ROWS, 3 * group), group)
    scale_mins = formats.pack_int4_scale_mins(scales, mins)
    widened = widen.widen_int4(formats.pack_int4(q, group), scale_mins, torch.float32)
    expected = formats.dequantize_int4(q, scale_mins[..., 0], scale_mins[..., 1])
    assert torch.equal(widened, expected)


@pytest.mark.parametrize("group", [32, 128])
def test_int4_packing_then_widening_gives_back_every_value(interpreted_widen, group):
    q = torch.randint(0, 16, (5, 256), dtype=torch.uint8)
    packed = formats.pack_int4(q, group)
    assert packed.shape == (5, 32) and packed.dtype == torch.int32
    unit = formats.pack_int4_scale_mins(torch.ones(5, 256 // group), torch.zeros(5, 256 // group))
    assert torch.equal(widen.widen_int4(packed, unit, torch.float32), q.float())


@pytest.mark.parametrize("fmt,group", [("int8", None), ("int8", 32), ("fp8", None)])
def test_scaled_values_widen_to_their_dequantized_values(interpreted_widen, fmt, group):
    w = torch.randn(ROWS, 608)  # 608 inputs: a last, partial block of BLOCK_INPUTS
    if fmt == "int8":
        q, scales = formats.quantize_int8(w, group)
        expected = formats.dequantize_int8(q, scales)
    else:
        q, scales = formats.quantize_fp8(w)
        expected, scales = formats.dequantize_fp8(q, scales), scales.view(-1, 1)
    assert torch.equal(widen.widen_scaled(q, scales, torch.float32), expected)
