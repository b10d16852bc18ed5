"""Cost of the torch backend's attention for a few queries over a long context, per layer.

Why the CPU fairness target is hard at 16k tokens: even one or two prompt tokens must
attend to the whole context in every layer. Shapes default to qwen2.5-coder-0.5b
(14 query heads, 2 KV heads, head dim 64), bf16.

    .venv/bin/python scripts/attention_cost.py [--contexts 1024 4096 16384] [--queries 1 2 8]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kamado.attention.torch_backend import matmul_attention


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
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = torch.bfloat16
    for ctx in args.contexts:
        keys = torch.randn(1, ctx, args.kv_heads, args.head_dim, dtype=dtype)
        values = torch.randn(1, ctx, args.kv_heads, args.head_dim, dtype=dtype)
        for n_q in args.queries:
            q = torch.randn(1, n_q, args.heads, args.head_dim, dtype=dtype)
            q_pos = torch.arange(ctx - n_q, ctx)[:, None]
            mask = (torch.arange(ctx)[None, :] <= q_pos)[None]
            us = per_call_us(lambda: matmul_attention(q, keys, values, mask))  # noqa: B023
            print(
                f"context {ctx:6d}, {n_q} queries: {us / 1e3:6.2f} ms a layer, "
                f"{us * args.layers / 1e3:6.1f} ms over {args.layers} layers"
            )


if __name__ == "__main__":
    main()
