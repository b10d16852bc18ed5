"""The torch backend's two paths for a chunk of queries over its context (plain matmuls up
to MATMUL_ATTENTION_MAX_QUERIES, tiles with a running softmax past it) agree with
torch's scaled_dot_product_attention, so the bound can move with what is faster without
changing outputs."""

import pytest
import torch
import torch.nn.functional as F

from kamado.attention import torch_backend
from kamado.attention.torch_backend import (
    MATMUL_ATTENTION_MAX_QUERIES,
    matmul_attention,
    tiled_attention,
    visible_keys,
)


def chunk_over_context(
    q_len: int, ctx: int = 300, window: int | None = None, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, ...]:
    """Random queries, keys and values of qwen2.5-coder-0.5b's heads, the chunk being the
    context's last q_len positions: each query sees keys up to itself (within `window`)."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 14, 2, 64
    q = (3 * torch.randn(q_len, heads, dim)).to(dtype)  # scores spread as a model's do
    keys = torch.randn(ctx, kv_heads, dim).to(dtype)
    values = torch.randn(ctx, kv_heads, dim).to(dtype)
    mask = visible_keys(torch.arange(ctx - q_len, ctx), torch.arange(ctx), window)
    return q, keys, values, mask


def sdpa(q, keys, values, mask) -> torch.Tensor:
    """The reference, in float32 on the same values."""
    return F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), keys.transpose(0, 1).float(), values.transpose(0, 1).float(),
        attn_mask=mask, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip


@pytest.mark.parametrize("q_len", [1, 5, MATMUL_ATTENTION_MAX_QUERIES])
def test_matmul_attention_agrees_with_sdpa_for_a_chunk_over_its_context(q_len):
    q, keys, values, mask = chunk_over_context(q_len)
    got = matmul_attention(q[None], keys[None], values[None], mask[None])[0]
    torch.testing.assert_close(got, sdpa(q, keys, values, mask), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("q_len", "ctx", "window"),
    [
        (9, 300, None),  # a chunk deep in its context
        (300, 300, None),  # a whole prompt: key tiles past a tile row's last query skipped
        (150, 300, 40),  # a sliding window: tiles before it skipped, tiles across it masked
        (300, 300, 100),
    ],
)
def test_tiled_attention_agrees_with_sdpa(monkeypatch, q_len, ctx, window):
    # Small tiles, so every case has several tile rows and key tiles, some of whose rows see
    # none of a tile's keys (the running softmax's -inf rows).
    monkeypatch.setattr(torch_backend, "QUERY_TILE", 64)
    monkeypatch.setattr(torch_backend, "MIN_KEY_TILE", 48)
    monkeypatch.setattr(torch_backend, "SCORE_TILE_BYTES", 1)
    q, keys, values, mask = chunk_over_context(q_len, ctx, window)
    got = tiled_attention(q, keys, values, window)
    torch.testing.assert_close(got, sdpa(q, keys, values, mask), rtol=1e-5, atol=1e-5)


def test_tiled_attention_in_bf16_computes_in_float32():
    # bf16 inputs, float32 inside: as close to the float32 reference as bf16 output allows
    # (its rounding, 2^-8 relative), over a 4k context in the default tiles.
    q, keys, values, mask = chunk_over_context(40, ctx=4096, dtype=torch.bfloat16)
    got = tiled_attention(q, keys, values, None)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), sdpa(q, keys, values, mask), rtol=8e-3, atol=4e-3)
