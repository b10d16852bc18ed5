"""Time the extend-attention kernel's tile configurations on CUDA (run on the GPU machine).

One sequence of heads/kv heads/head_dim 32/8/128 (Qwen3-8B), a query chunk at the end of
its paged context: prints TFLOP/s per (block_m, block_n, warps, stages), and each
configuration's largest difference from the default's output.
"""

from __future__ import annotations

import random

import torch
import triton

from kamado.attention.triton_kernels import extend_attention

CONFIGS = [(128, 64, 4, 3), (128, 64, 4, 4), (128, 64, 4, 2), (128, 128, 4, 3),
           (128, 128, 4, 2), (128, 32, 4, 4), (64, 64, 4, 4), (256, 64, 8, 3),
           (128, 64, 8, 2), (128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 2),
           (128, 128, 8, 3), (256, 128, 8, 2), (256, 64, 8, 2), (64, 128, 4, 3)]  # fmt: skip


def main() -> None:
    heads, kv_heads, dim, bs = 32, 8, 128, 16
    for q_len, ctx in [(8192, 8192), (8192, 131072)]:
        blocks = list(range(ctx // bs))
        random.Random(0).shuffle(blocks)
        table = torch.tensor([blocks], dtype=torch.int32, device="cuda")
        k = torch.randn(ctx, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        q = torch.randn(q_len, heads, dim, device="cuda", dtype=torch.bfloat16)
        ints = dict(dtype=torch.int32, device="cuda")
        args = (q, k, v, table, torch.tensor([0], **ints), torch.tensor([q_len], **ints),
                torch.tensor([ctx], **ints), q_len, bs)  # fmt: skip
        flops = 4 * heads * dim * (q_len * (ctx - q_len) + q_len * q_len / 2)
        base = extend_attention(*args, 0, 128, 64, 8, 2)
        for bm, bn, warps, stages in CONFIGS:
            try:
                out = extend_attention(*args, 0, bm, bn, warps, stages)
                ms = triton.testing.do_bench(
                    lambda: extend_attention(*args, 0, bm, bn, warps, stages),  # noqa: B023
                    return_mode="median",
                )
            except Exception as e:  # out of shared memory, say: report and go on
                print(f"q {q_len} ctx {ctx} {bm}x{bn} w{warps} s{stages}: {type(e).__name__}")
                continue
            diff = float((out.float() - base.float()).abs().max())
            print(
                f"q {q_len:5d} ctx {ctx:6d} {bm:3d}x{bn:3d} w{warps} s{stages}: "
                f"{ms:8.2f} ms {flops / ms / 1e9:6.0f} TFLOP/s  max diff {diff:.3g}",
                flush=True,
            )


if __name__ == "__main__":
    main()
