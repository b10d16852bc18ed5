"""Cost of the torch backend's attention for a few queries over a long context, per layer:
its plain-matmul path (`chunk_attention`, in blocks of queries) beside the same matmuls in
one piece and scaled_dot_product_attention with the same mask, the path it takes for
chunks past MATMUL_ATTENTION_MAX_QUERIES.

Why the CPU fairness target is hard at 16k tokens: even one or two prompt tokens must
attend to the whole context in every layer. Shapes default to qwen2.5-coder-0.5b
(14 query heads, 2 KV heads, head dim 64), in float32 (what the engine runs on a CPU
without native bf16).

    .venv/bin/python scripts/attention_cost.py [--contexts 1024 4096 16384] [--queries 1 2 8]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kamado.attention.torch_backend import chunk_attention, matmul_attention


def per_call_us(fn, repeats: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2, 8])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    for ctx in args.contexts:
        keys = torch.randn(1, ctx, args.kv_heads, args.head_dim, dtype=dtype)
        values = torch.randn(1, ctx, args.kv_heads, args.head_dim, dtype=dtype)
        for n_q in args.queries:
            q = torch.randn(1, n_q, args.heads, args.head_dim, dtype=dtype)
            q_pos = torch.arange(ctx - n_q, ctx)[:, None]
            mask = (torch.arange(ctx)[None, :] <= q_pos)[None]
            us = per_call_us(
                lambda: chunk_attention(q[0], keys[0], values[0], mask[0])  # noqa: B023
            )
            whole_us = per_call_us(lambda: matmul_attention(q, keys, values, mask))  # noqa: B023
            heads_first = [t[0].transpose(0, 1) for t in (q, keys, values)]
            sdpa_us = per_call_us(
                lambda: F.scaled_dot_product_attention(
                    *heads_first,  # noqa: B023
                    attn_mask=mask[0],  # noqa: B023
                    enable_gqa=True,
                )
            )
            print(
                f"context {ctx:6d}, {n_q:4d} queries: {us / 1e3:7.2f} ms a layer, "
                f"{us * args.layers / 1e3:7.1f} ms over {args.layers} layers; in one piece "
                f"{whole_us / 1e3:7.2f} ms; scaled_dot_product_attention {sdpa_us / 1e3:7.2f} ms"
            )


if __name__ == "__main__":
    main()
