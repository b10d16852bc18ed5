"""The torch backend's two paths for a chunk of queries over its context (plain matmuls up
to MATMUL_ATTENTION_MAX_QUERIES, scaled_dot_product_attention past it) agree with each
other, so the bound can move with what is faster without changing outputs."""

import pytest
import torch
import torch.nn.functional as F

from kamado.attention.torch_backend import MATMUL_ATTENTION_MAX_QUERIES, matmul_attention


@pytest.mark.parametrize("q_len", [1, 17, MATMUL_ATTENTION_MAX_QUERIES[torch.float32]])
def test_matmul_attention_agrees_with_sdpa_for_a_chunk_over_its_context(q_len):
    torch.manual_seed(0)
    ctx, heads, kv_heads, dim = 300, 14, 2, 64  # qwen2.5-coder-0.5b's heads
    q = torch.randn(q_len, heads, dim)
    keys, values = torch.randn(ctx, kv_heads, dim), torch.randn(ctx, kv_heads, dim)
    # The chunk is the context's last q_len positions: each query sees keys up to itself.
    mask = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    got = matmul_attention(q[None], keys[None], values[None], mask[None])[0]
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=mask, enable_gqa=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
