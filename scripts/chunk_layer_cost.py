"""What one layer of a staged chunk costs on the CPU, by its tokens, outside the engine.

Times one decoder layer's four matmuls (QKV, output, gate/up, down) at the row count a
chunk of N tokens beside 3 decodes is padded to (row_buckets), and `tiled_attention` of
its N queries over a deep prompt's keys, at qwen2.5-coder-0.5b's shapes with random bf16
weights and K/V: the median of 7 calls after a first one. Then first calls at row counts
not run before. Compare with what the same chunk sizes added to a step in a fairness run
(`scripts/fairness_steps.py`).

    python scripts/chunk_layer_cost.py [--keys 12000]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kamado.attention.torch_backend import tiled_attention
from kamado.models.row_buckets import bucket_rows

HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTERMEDIATE = 14, 2, 64, 896, 4864
DECODES = 3  # the fairness bench's streams, whose rows join the chunk's


def ms(fn: Callable[[int], object], arg: int) -> float:
    started = time.perf_counter()
    fn(arg)
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=12000)
    args = parser.parse_args()
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    keys = torch.randn(args.keys, KV_HEADS, HEAD_DIM, dtype=bf16)
    values = torch.randn(args.keys, KV_HEADS, HEAD_DIM, dtype=bf16)
    shapes = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN),
              (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]  # fmt: skip
    weights = [torch.randn(out, inp, dtype=bf16) * 0.02 for out, inp in shapes]

    def matmuls(rows: int) -> None:
        for w in weights:
            torch.randn(rows, w.shape[1], dtype=bf16) @ w.T

    def attention(tokens: int) -> None:
        tiled_attention(torch.randn(tokens, HEADS, HEAD_DIM, dtype=bf16), keys, values, None)

    def median(fn: Callable[[int], object], arg: int) -> float:
        fn(arg)
        return statistics.median(ms(fn, arg) for _ in range(7))

    for tokens in (64, 96, 128, 160, 192):
        rows = bucket_rows(tokens + DECODES)
        print(
            f"{tokens:4d} tokens: matmuls at {rows} rows {median(matmuls, rows):6.1f} ms,"
            f" attention over {args.keys} keys {median(attention, tokens):6.1f} ms",
            flush=True,
        )
    print("first calls at sizes not run before, then again:")
    for tokens in (112, 144, 176, 208):
        rows = bucket_rows(tokens + DECODES)
        first, again = ms(matmuls, rows), ms(matmuls, rows)
        att_first, att_again = ms(attention, tokens), ms(attention, tokens)
        print(
            f"{tokens:4d} tokens: matmuls {first:6.1f} then {again:6.1f} ms; "
            f"attention {att_first:6.1f} then {att_again:6.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
