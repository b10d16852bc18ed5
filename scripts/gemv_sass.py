"""SASS instructions per weight byte of the CUDA GEMV (triton_matmul._rowwise_kernel) at
one input row, for each configuration the autotuner chooses among, compiled for sm_90 on
this machine: no GPU needed (Triton and the ptxas, nvdisasm and cuobjdump of its wheel).

A GEMV near the memory's bandwidth also has to issue its instructions: an H200 issues at
most 132 SMs x 4 warp-instructions a cycle. fp8 weights take more instructions per byte
than bf16 (each e4m3 pair widens to fp16, then each value to float32, before its FMA),
so at the same bytes a second they need more of the issue slots. The count is the
kernel's static one, so it is the work of a whole program only where one tile spans K
(BLOCK_K >= K); other rows print "-" for it.

    python scripts/gemv_sass.py [N K]   (default 4096 4096: Qwen3-8B's o_proj)
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import pytest
import torch
import triton

from kamado.surgery import triton_matmul as tm
from tests.kernels.test_compile_for_hopper import compile_for_hopper, recorded_launches

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
# The H200's ceiling: SMs x warp schedulers x boost clock x threads a warp.
ISSUE_SLOTS = 132 * 4 * 1.98e9 * 32  # thread-instructions a second


def sass_of(cubin: bytes) -> tuple[list[str], int]:
    """The cubin's instructions (opcode first) and registers a thread."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run(
            [os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True
        ).stdout
        usage = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    ops = []
    for line in listing.splitlines():
        if found := re.match(r"\s*/\*[0-9a-f]{4}\*/\s*(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line):
            ops.append(found.group(1))
    registers = re.search(r"REG:(\d+)", usage)
    return ops, int(registers.group(1)) if registers else -1


def launches(weights: str, n: int, k: int) -> list:
    x = torch.randn(1, k).to(torch.bfloat16)
    with pytest.MonkeyPatch.context() as patch:
        if weights == "fp8":
            q = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
            return recorded_launches(lambda: tm.fp8_matmul(x, q, torch.ones(n, 1), None), patch)
        w = torch.zeros(n, k, dtype=torch.bfloat16)
        return recorded_launches(lambda: tm.dense_matmul(x, w, None), patch)


def main() -> None:
    n, k = (int(a) for a in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 4096)
    print(f"_rowwise_kernel at one input row, {n}x{k}, compiled for sm_90")
    print("weights  (BLOCK_N, BLOCK_K, warps, split, sums)  regs  instrs  per byte  "
          "issue at 4 TB/s  most common")  # fmt: skip
    for weights, byte_width in (("bf16", 2), ("fp8", 1)):
        for launch in launches(weights, n, k):
            a = launch.kwargs
            config = (a["BLOCK_N"], a["BLOCK_K"], a["num_warps"], a["SPLIT_K"], a["STEP_SUMS"])
            ops, registers = sass_of(compile_for_hopper(launch).asm["cubin"])
            common = ", ".join(f"{op} {c}" for op, c in collections.Counter(ops).most_common(4))
            per_byte, share = "-", "-"
            if a["BLOCK_K"] >= k:
                per_thread_bytes = a["BLOCK_N"] * k * byte_width / (32 * a["num_warps"])
                instructions_per_byte = len(ops) / per_thread_bytes
                per_byte = f"{instructions_per_byte:.2f}"
                share = f"{4e12 * instructions_per_byte / ISSUE_SLOTS:.0%}"
            print(f"{weights:7}  {config!s:40}  {registers:4}  {len(ops):6}  {per_byte:>8}  "
                  f"{share:>15}  {common}")  # fmt: skip


if __name__ == "__main__":
    main()
