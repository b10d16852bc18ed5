"""Cost of the torch backend's attention for one sequence's chunk of queries over its
context, per layer, by path: plain matmuls with the scores in one piece (`matmul_attention`,
what chunks of up to MATMUL_ATTENTION_MAX_QUERIES take), tiles with a running softmax
(`tiled_attention`, longer chunks), and scaled_dot_product_attention with the same mask
(what chunks past 16 queries took in bf16 before the tiles). Shapes default to
qwen2.5-coder-0.5b (14 query heads, 2 KV heads, head dim 64), in the dtype the engine runs
on this CPU (bf16 where it is native); the keys and values are views into a larger cache,
as the engine reads them.

    .venv/bin/python scripts/attention_cost.py [--contexts 4096 16384] [--queries 1 8 32]
        [--dtype bfloat16|float32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kamado.attention.torch_backend import matmul_attention, tiled_attention, visible_keys

# The matmul path makes every score at once: past this, it is not run (2,048 queries over
# 16k keys would take 1.9 GB).
SCORES_IN_ONE_PIECE_MAX_BYTES = 256 << 20


def per_call_ms(paths: dict[str, Callable[[], object]], rounds: int = 7) -> dict[str, float]:
    """Median ms a call of each path, the paths interleaved in each round so that the
    machine's drift falls on all of them alike."""
    for fn in paths.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--queries", type=int, nargs="+", default=[1, 2, 8, 16, 32, 96, 512, 2048])
    p.add_argument("--heads", type=int, default=14)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    args = p.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(f"ms a layer, {args.dtype}, torch threads {torch.get_num_threads()}")
    for ctx in args.contexts:
        cache = torch.randn(2, ctx + 64, args.kv_heads, args.head_dim).to(dtype)
        keys, values = cache[0, 32 : 32 + ctx], cache[1, 32 : 32 + ctx]
        for n_q in (n for n in args.queries if n <= ctx):
            q = torch.randn(n_q, args.heads, args.head_dim).to(dtype)
            mask = visible_keys(torch.arange(ctx - n_q, ctx), torch.arange(ctx), None)
            heads_first = [t.transpose(0, 1) for t in (q, keys, values)]
            paths = {
                "tiles": lambda: tiled_attention(q, keys, values, None),  # noqa: B023
                "sdpa": lambda: F.scaled_dot_product_attention(
                    *heads_first, attn_mask=mask, enable_gqa=True  # noqa: B023
                ),
            }  # fmt: skip
            if n_q * args.heads * ctx * 4 <= SCORES_IN_ONE_PIECE_MAX_BYTES:
                paths["matmuls"] = lambda: matmul_attention(q[None], keys[None], values[None], mask[None])  # noqa: B023, E501  # fmt: skip
            ms = per_call_ms(paths)
            one_piece = f"{ms['matmuls']:8.2f}" if "matmuls" in ms else "       -"
            print(
                f"context {ctx:6d}, {n_q:5d} queries: matmuls {one_piece}   "
                f"tiles {ms['tiles']:8.2f}   scaled_dot_product_attention {ms['sdpa']:8.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
