"""Compressed linears on CPU against x @ W.T, W dequantized from the same compressed tensors
in float32. torch's packed int8/int4 kernels compute in bf16 (cpu_matmul.py says why), so
their results may differ by bf16 rounding: under 1% relative. The tiled path (grouped
int8) computes in float32."""

from __future__ import annotations

import pytest
import torch

from kamado.surgery import formats
from kamado.surgery.qlinear import Int4Linear, Int8Linear

BF16_TOLERANCE = 1e-2
FLOAT32_TOLERANCE = 1e-5


def relative_error(module, reference_w, bias, dtype, shape=(3, 5)):
    torch.manual_seed(1)
    x = torch.randn(*shape, reference_w.shape[1], dtype=dtype)
    expected = x.float() @ reference_w.T + (0 if bias is None else bias.float())
    got = module(x)
    assert got.dtype == dtype and got.shape == expected.shape
    return float((got.float() - expected).norm() / expected.norm())


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(600, 512) * 0.02, torch.randn(600)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rowwise_matches_its_dequantized_weight(weight, dtype):
    w, bias = weight
    bias = bias.to(dtype)  # a model's biases are in its dtype
    q, scales = formats.quantize_int8(w)
    module = Int8Linear(q, scales, bias)
    reference = formats.dequantize_int8(q, scales.to(torch.bfloat16).float())  # stored in bf16
    assert relative_error(module, reference, bias, dtype) < BF16_TOLERANCE


def test_int8_grouped_is_computed_in_float32(weight):
    w, bias = weight
    q, scales = formats.quantize_int8(w, 32)
    module = Int8Linear(q, scales, bias)
    reference = formats.dequantize_int8(q, scales)
    assert relative_error(module, reference, bias, torch.float32) < FLOAT32_TOLERANCE


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_matches_its_dequantized_weight(weight, group, dtype):
    w, _ = weight
    q, scales, mins = formats.quantize_int4(w, group)
    module = Int4Linear(q, scales, mins, None)
    reference = formats.dequantize_int4(q, scales, mins)
    assert relative_error(module, reference, None, dtype) < BF16_TOLERANCE


def test_compressed_layers_hold_fewer_bytes_than_bf16(weight):
    from kamado.surgery.pipeline import module_bytes

    w, _ = weight
    bf16 = w.numel() * 2
    int8 = module_bytes(Int8Linear(*formats.quantize_int8(w), None))
    int4 = module_bytes(Int4Linear(*formats.quantize_int4(w, 128), None))
    assert int8 < 0.51 * bf16 and int4 < 0.3 * bf16
