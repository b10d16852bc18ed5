"""Compressed linears on CPU against x @ W.T, W dequantized from the same compressed tensors
in float32. torch's packed int8/int4 kernels compute in bf16 (cpu_matmul.py says why), so
their results may differ by bf16 rounding: under 1% relative. Grouped int8 runs as two of
those int4 layers (low and high nibbles)."""

from __future__ import annotations

import pytest
import torch

from kamado.surgery import cpu_matmul, formats
from kamado.surgery.qlinear import Int4Linear, Int8Linear

BF16_TOLERANCE = 1e-2


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


# Decode-sized inputs take torch's int8 kernel, a prompt's chunk the weight widened in tiles.
@pytest.mark.parametrize("shape", [(3, 5), (2, cpu_matmul.WIDEN_FROM_ROWS)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rowwise_matches_its_dequantized_weight(weight, dtype, shape, monkeypatch):
    monkeypatch.setattr(cpu_matmul, "TILE_ROWS", 256)  # tiles of 256, 256 and 88 rows
    w, bias = weight
    bias = bias.to(dtype)  # a model's biases are in its dtype
    q, scales = formats.quantize_int8(w)
    module = Int8Linear(q, scales, bias)
    reference = formats.dequantize_int8(q, scales.to(torch.bfloat16).float())  # stored in bf16
    assert relative_error(module, reference, bias, dtype, shape) < BF16_TOLERANCE


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_grouped_matches_its_dequantized_weight(weight, group, dtype):
    w, bias = weight
    bias = bias.to(dtype)
    q, scales = formats.quantize_int8(w, group)
    module = Int8Linear(q, scales, bias)
    reference = formats.dequantize_int8(q, scales.to(torch.bfloat16).float())  # stored in bf16
    assert relative_error(module, reference, bias, dtype) < BF16_TOLERANCE


def test_int8_grouped_splits_every_int8_value_exactly():
    # q's 8 rows hold all 256 int8 values, each row in two groups of 32. With scales of 1
    # and one-hot inputs each output is one weight: an integer that bf16 holds exactly.
    q = torch.arange(-128, 128).to(torch.int8).view(8, 32)
    q = torch.cat([q, q.flip(1)], dim=1)
    module = Int8Linear(q, torch.ones(8, 2), None)
    assert module.grouped_cpu
    got = module(torch.eye(64, dtype=torch.bfloat16))  # row k: column k of q
    assert torch.equal(got.float(), q.T.float())


def test_int8_grouped_refuses_a_group_the_kernel_lacks():
    q, scales = formats.quantize_int8(torch.randn(16, 64), 16)
    with pytest.raises(ValueError, match="groups of"):
        Int8Linear(q, scales, None)


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
