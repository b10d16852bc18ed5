"""Extend attention of a short chunk over a long context, a head a program against a GQA
group a program (triton_backend.extend_heads_per_program). CUDA; run on the GPU machine.

One sequence of Qwen3-8B's heads (32 query, 8 KV, head_dim 128), a chunk of new queries
at the end of its paged bf16 context, tiles and splits as the backend picks them
(`extend_launch`). Prints the kernel's time (with the merge of splits) each way, the
largest difference between the two outputs, and the bandwidth the context's unique K/V
bytes imply.

    python scripts/extend_heads_sweep.py [--queries 1 16 64 128 192 256] [--contexts ...]
"""

from __future__ import annotations

import argparse
import random
from dataclasses import astuple

import torch
import triton

from kamado.attention.triton_backend import extend_heads_per_program, extend_launch
from kamado.attention.triton_kernels import extend_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor, ctx: int,
        heads: int) -> torch.Tensor:  # fmt: skip
    q_len = q.shape[0]
    tile, splits, heads = extend_launch(q_len, 1, HEADS, KV_HEADS, ctx, heads)
    ints = dict(dtype=torch.int32, device="cuda")
    return extend_attention(
        q, k, v, table, torch.tensor([0], **ints), torch.tensor([q_len], **ints),
        torch.tensor([ctx], **ints), q_len, BLOCK_SIZE, 0, *astuple(tile),
        num_splits=splits, heads_per_program=heads,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 16, 64, 128, 192, 256])
    parser.add_argument("--contexts", type=int, nargs="+", default=[16384, 65536, 131072])
    args = parser.parse_args()
    group = HEADS // KV_HEADS
    print("queries  context  backend picks  one head us  group us  max diff  group GB/s")
    for ctx in args.contexts:
        blocks = list(range(ctx // BLOCK_SIZE))
        random.Random(0).shuffle(blocks)
        table = torch.tensor([blocks], dtype=torch.int32, device="cuda")
        k = torch.randn(ctx, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        for q_len in args.queries:
            q = torch.randn(q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            times, outs = [], []
            for heads in (1, group):
                outs.append(run(q, k, v, table, ctx, heads))
                ms = triton.testing.do_bench(
                    lambda: run(q, k, v, table, ctx, heads),  # noqa: B023
                    return_mode="median",
                )
                times.append(ms * 1e3)
            diff = float((outs[0].float() - outs[1].float()).abs().max())
            picks = extend_heads_per_program(q_len, HEADS, KV_HEADS)
            kv_bytes = 2 * k.numel() * k.element_size()
            print(
                f"{q_len:7d}  {ctx:7d}  {picks:13d}  {times[0]:11.1f}  {times[1]:8.1f}  "
                f"{diff:8.2g}  {kv_bytes / times[1] / 1e3:10.0f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
