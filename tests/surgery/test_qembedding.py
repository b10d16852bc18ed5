"""A compressed token table: each looked-up row is exactly its dequantized row."""

from __future__ import annotations

import pytest
import torch

from kamado.surgery import formats
from kamado.surgery.pipeline import module_bytes
from kamado.surgery.qembedding import GroupedEmbedding

IDS = torch.tensor([[0, 5, 99], [5, 3, 1]])


@pytest.fixture
def table():
    torch.manual_seed(0)
    return torch.randn(100, 64)


def test_int8_rows_are_their_dequantized_rows(table):
    q, scales = formats.quantize_int8(table, 32)
    embedding = GroupedEmbedding(q, scales, None, torch.float32)
    expected = formats.dequantize_int8(q, scales)[IDS]
    assert torch.equal(embedding(IDS), expected)


def test_int4_rows_are_their_dequantized_rows_at_half_a_byte(table):
    q, scales, mins = formats.quantize_int4(table, 32)
    embedding = GroupedEmbedding(q, scales, mins, torch.bfloat16)
    got = embedding(IDS)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, formats.dequantize_int4(q, scales, mins)[IDS].to(torch.bfloat16))
    assert embedding.q.numel() == table.numel() // 2  # two values a byte
    assert module_bytes(embedding) < 0.4 * table.numel() * 2  # against bf16
