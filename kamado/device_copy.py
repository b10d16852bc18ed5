"""Copies of small host data (token ids, positions, attention metadata) to the device that
never wait for the work already queued there.

`torch.tensor(values, device="cuda")` copies from pageable memory and waits until the
device has run everything queued before it (a non-blocking copy from pageable memory may
wait too): a step launched while the one before it runs would then queue its kernels only
once the device is idle. A copy from pinned memory just joins the queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long
) -> torch.Tensor:
    """`values` as a tensor on `device`, queued behind the work there."""
    host = torch.as_tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def copy_into(out: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into a device buffer, queued behind the work there."""
    if out.device.type != "cuda":
        out.copy_(host)
        return
    out.copy_(host.pin_memory(), non_blocking=True)
