"""Rotary tables: grown on demand, and held in place once CUDA graphs read them."""

from __future__ import annotations

import pytest
import torch

from kamado.models.rope import RotaryEmbedding
from kamado.models.synthetic import tiny_config


def test_grown_tables_keep_the_positions_they_had():
    rope = RotaryEmbedding(tiny_config("llama", max_position_embeddings=64), torch.device("cpu"))
    cos, sin = rope.cos.clone(), rope.sin.clone()
    rope.reserve(200)
    assert rope.cos.shape[0] >= 200
    assert torch.equal(rope.cos[:64], cos) and torch.equal(rope.sin[:64], sin)


def test_held_tables_never_move_and_refuse_to_grow():
    """A graph captured after hold() reads the tables at their addresses: growing them
    would leave it reading freed memory, so it is an error instead."""
    rope = RotaryEmbedding(tiny_config("llama", max_position_embeddings=64), torch.device("cpu"))
    rope.hold(100)
    address = rope.cos.data_ptr()
    rope.reserve(rope.cos.shape[0])  # within the tables: nothing to do
    assert rope.cos.data_ptr() == address
    with pytest.raises(RuntimeError, match="CUDA graphs"):
        rope.reserve(rope.cos.shape[0] + 1)
    assert rope.cos.data_ptr() == address
