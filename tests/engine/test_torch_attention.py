"""The torch backend's two paths for a chunk of queries over its context (plain matmuls up
to MATMUL_ATTENTION_MAX_QUERIES, scaled_dot_product_attention past it) agree with each
other, so the bound can move with what is faster without changing outputs."""

import pytest
import torch
import torch.nn.functional as F

from kamado.attention import torch_backend
from kamado.attention.torch_backend import (
    MATMUL_ATTENTION_MAX_QUERIES,
    chunk_attention,
    matmul_attention,
)


def chunk_over_context(q_len: int, ctx: int = 300) -> tuple[torch.Tensor, ...]:
    """Random queries, keys and values of qwen2.5-coder-0.5b's heads, the chunk being the
    context's last q_len positions: each query sees keys up to itself."""
    torch.manual_seed(0)
    heads, kv_heads, dim = 14, 2, 64
    q = torch.randn(q_len, heads, dim)
    keys, values = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    return q, keys, values, mask


def sdpa(q, keys, values, mask) -> torch.Tensor:
    return F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip


@pytest.mark.parametrize("q_len", [1, 17, MATMUL_ATTENTION_MAX_QUERIES[torch.float32]])
def test_matmul_attention_agrees_with_sdpa_for_a_chunk_over_its_context(q_len):
    q, keys, values, mask = chunk_over_context(q_len)
    got = matmul_attention(q[None], keys[None], values[None], mask[None])[0]
    expected = sdpa(q, keys, values, mask)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_a_chunk_attended_in_blocks_of_queries_gives_the_same_output(monkeypatch):
    # Scores for 5 queries at a time (14 heads x 300 keys x 4 bytes each): 17 queries go
    # in blocks of 5, 5, 5 and 2.
    monkeypatch.setattr(torch_backend, "SCORE_BLOCK_BYTES", 5 * 14 * 300 * 4)
    q, keys, values, mask = chunk_over_context(17)
    torch.testing.assert_close(
        chunk_attention(q, keys, values, mask), sdpa(q, keys, values, mask), rtol=1e-5, atol=1e-5
    )
