"""Time of one layer's decode attention on CUDA (the Triton split kernel and its merge), per
context length and batch, for Qwen3-8B's heads (32 query heads, 8 KV heads, head dim 128)
over a paged cache with blocks scattered as a long-running server leaves them, in bf16 or
as int8/fp8 codes with a scale per token and kv head.

    python scripts/decode_attention_speed.py [--contexts 512 8192 32768 131072] [--batches 1 4]
        [--kv bf16|int8|fp8] [--short-n 32 128]

Each figure is the median over 20 replays of a CUDA graph of 20 calls back to back, as a
captured decode step runs them (with PDL where the device has it), per call. `--short-n`
compares tiles for the slices of short contexts (decode_attention's short_n, its default
where not given; 128, the long-context tile, takes the short path's code up to 128 keys).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from kamado.attention.triton_backend import decode_splits
from kamado.attention.triton_kernels import decode_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


CODES = {"bf16": torch.bfloat16, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def call_us(batch: int, context: int, kv: str, short_n: int | None, calls: int = 20) -> float:
    blocks_per_row = -(-context // BLOCK_SIZE)
    blocks = batch * blocks_per_row + 8
    tables = torch.randperm(blocks, device="cuda")[: batch * blocks_per_row]
    tables = tables.view(batch, blocks_per_row).int()
    shape = (blocks * BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = (torch.randn(shape, device="cuda") for _ in range(2))
    if kv == "int8":
        k_cache, v_cache = k_cache.round(), v_cache.round()
    k_cache, v_cache = k_cache.to(CODES[kv]), v_cache.to(CODES[kv])
    scales = None
    if kv != "bf16":
        scales = (torch.rand(shape[:2], device="cuda"), torch.rand(shape[:2], device="cuda"))
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda").bfloat16()
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    splits = decode_splits(batch, KV_HEADS)
    tile = {} if short_n is None else {"short_n": short_n}

    def run() -> torch.Tensor:
        return decode_attention(
            q, k_cache, v_cache, tables, lens, BLOCK_SIZE, splits, scales=scales, **tile
        )

    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            run()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 8192, 32768, 131072])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--kv", choices=list(CODES), default="bf16")
    parser.add_argument("--short-n", type=int, nargs="+", default=[None])
    args = parser.parse_args()
    print("batch  context  splits  short_n  us/call  KV GB/s")
    for batch in args.batches:
        for context in args.contexts:
            for short_n in args.short_n:
                us = call_us(batch, context, args.kv, short_n)
                kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * CODES[args.kv].itemsize
                splits = decode_splits(batch, KV_HEADS)
                print(
                    f"{batch:5d}  {context:7d}  {splits:6d}  {short_n or '-':>7}  {us:7.1f}  "
                    f"{kv_bytes / us / 1e3:7.0f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
