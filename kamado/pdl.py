"""Programmatic dependent launch (PDL) for the Triton kernels of a decode step (Hopper on).

A decode step is hundreds of short kernels, each reading what the one before it wrote, and
each paid a launch and a ramp while the GPU drained the one before. A kernel launched with
PDL may start while the kernel before it on the stream is finishing: its programs become
resident and may read what no kernel writes (weights), then wait (`wait_for_inputs`)
before reading anything else and before writing anything. So its launch and its first
weight loads overlap the end of the kernel before it. Each kernel lets the next one start
as soon as all of its own programs run (`let_next_start`). CUDA graphs keep these
dependencies when they capture such launches.

Rules for a kernel that takes PDL:
- nothing is written, and nothing that an earlier kernel writes is read, before the wait;
- every program waits before it exits, even one with nothing to do: were all of a
  kernel's programs to skip the wait, it could finish before the kernel before it, and
  the next kernel's wait would not cover that one.
Kernels launched without PDL (cuBLAS, torch's own) start after the one before has finished,
as usual, and a PDL kernel after one of them starts when it finishes.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

# False launches every kernel as on a device without PDL (scripts/decode_profile.py --pdl
# compares the two); read at each launch, so it holds for graphs captured after it is set.
enabled = True


@cache
def _supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


def launch_options(device: torch.device) -> dict[str, bool]:
    """Keyword arguments for launching a PDL-taking kernel on `device`: its PDL flag, and
    the launch attribute where the device has PDL."""
    if enabled and _supported(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


@triton.jit
def let_next_start(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_for_inputs(PDL: tl.constexpr):
    if PDL:
        gdc_wait()
