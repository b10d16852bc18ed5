"""The weight formats: rounding stays within half a step, and packing is lossless."""

from __future__ import annotations

import pytest
import torch

from kamado.surgery import formats


@pytest.fixture
def w() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(48, 256) * 0.02


@pytest.mark.parametrize("group", [None, 32, 128])
def test_int8_rounds_each_weight_to_its_nearest_step(w, group):
    q, scales = formats.quantize_int8(w, group)
    assert q.dtype == torch.int8 and scales.shape == (48, 256 // (group or 256))
    step = scales.repeat_interleave(group or 256, dim=1)
    assert ((formats.dequantize_int8(q, scales) - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("group", [32, 128])
def test_int4_rounds_each_weight_to_its_nearest_step(w, group):
    q, scales, mins = formats.quantize_int4(w, group, torch.float32)
    assert q.max() <= 15 and scales.shape == mins.shape == (48, 256 // group)
    step = scales.repeat_interleave(group, dim=1)
    assert ((formats.dequantize_int4(q, scales, mins) - w).abs() <= step / 2 + 1e-7).all()


def test_int4_scales_are_stored_rounded_and_q_uses_the_rounded_values(w):
    q, scales, mins = formats.quantize_int4(w, 128, torch.float16)
    assert scales.dtype == mins.dtype == torch.float16
    # fp16 scales move the grid slightly; still within half a step plus the rounding
    step = scales.float().repeat_interleave(128, dim=1)
    assert ((formats.dequantize_int4(q, scales, mins) - w).abs() <= 0.51 * step + 1e-6).all()


def test_fp8_keeps_three_mantissa_bits(w):
    q, scales = formats.quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn
    error = (formats.dequantize_fp8(q, scales) - w).abs()
    # e4m3: relative spacing 2^-3, so rounding is within 2^-4 of the value (normals)
    big = w.abs() > scales[:, None] * 2**-6
    assert (error[big] <= w.abs()[big] * 2**-4 + 1e-9).all()


def test_int4_words_hold_four_input_pairs_of_their_group_evens_low():
    """Word j of a group of 32 (four words) holds inputs 2j, 2j + 1, 8 + 2j, 9 + 2j, ...,
    24 + 2j, 25 + 2j as its elements 0..7; element 2p + b is nibble 4b + p."""
    q = torch.zeros(1, 64, dtype=torch.uint8)
    q[0, 8 + 2] = 7  # group 0, pair 5: word 1's element 2 (p = 1, b = 0), nibble 1
    q[0, 8 + 3] = 5  # its partner: word 1's element 3 (p = 1, b = 1), nibble 5
    q[0, 32 + 6] = 9  # group 1, pair 3: word 3 of the group (word 7), element 0, nibble 0
    q[0, 63] = 15  # group 1's last input: word 7's element 7, the top nibble (sign bit)
    words = formats.pack_int4(q, 32)
    expected = torch.zeros(1, 8, dtype=torch.int32)
    expected[0, 1] = 7 << 4 | 5 << 20
    expected[0, 7] = 9 - (1 << 28)  # 0xF0000009 as int32
    assert torch.equal(words, expected)


def test_int4_groups_must_pack_into_whole_words():
    with pytest.raises(ValueError, match="whole words"):
        formats.pack_int4(torch.zeros(2, 48, dtype=torch.uint8), 12)


def test_groups_must_divide_the_input_size(w):
    with pytest.raises(ValueError, match="multiple of the group size"):
        formats.quantize_int8(w, 96)
