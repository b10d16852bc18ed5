"""Matmul row counts rounded up to a few buckets, for 16-bit matmuls on the CPU.

oneDNN makes a kernel for each new matmul shape the first time it sees it: on a 2-core
Xeon, qwen2.5-coder-0.5b's four decoder matmuls took 5-7 ms at a row count not seen
before against 2 ms again, and 17-19 ms against 3-5 ms at 100-111 rows
(bench/results/2026-12-05-cpu-onednn-new-row-counts.txt). A step's rows are its prompt
chunk plus its decodes, so over a night they take hundreds of counts, and each new one
stalled the decodes of its step. Rounding rows up to a bucket (every count to 8, then four
a doubling: at most a quarter more rows) leaves few shapes, and the engine runs each once
at start (ModelRunner). The padded rows are zeros, computed and dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXACT_UP_TO = 8  # row counts this small are buckets themselves
PER_DOUBLING = 4


def bucket_rows(num_rows: int) -> int:
    """The smallest bucket of at least num_rows rows."""
    if num_rows <= EXACT_UP_TO:
        return num_rows
    power = 1 << ((num_rows - 1).bit_length() - 1)  # the largest power of two below num_rows
    step = power // PER_DOUBLING
    return -(-num_rows // step) * step


def row_buckets(up_to: int) -> list[int]:
    """Every bucket of at most up_to rows."""
    buckets = [1]
    while (next_bucket := bucket_rows(buckets[-1] + 1)) <= up_to:
        buckets.append(next_bucket)
    return buckets


def rounds_rows(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether matmuls on this device and dtype take rows in buckets: 16-bit ones on the
    CPU. float32 goes to MKL, whose first call at a new row count costs no more (4864x896
    at 101-107 rows: 4.0-5.9 ms the first time, 4.1-5.7 again; bf16 1.7-2.0 against
    0.8-1.3; bench/results/2026-12-06-cpu-first-call-float32-vs-bf16.txt), and a GPU's
    kernels take any row count (CUDA graphs fix their own)."""
    return device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """x [T, ...] with zero rows appended up to bucket_rows(T) where rounds_rows; else x."""
    num_rows = x.shape[0]
    bucket = bucket_rows(num_rows)
    if bucket == num_rows or not rounds_rows(x.device, x.dtype):
        return x
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, bucket - num_rows))
