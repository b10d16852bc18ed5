"""A token table kept compressed: a lookup widens only the rows it reads.

GGUF files store the token table quantized (Q8_0, Q5_0, Q4_K, ...). Widened to the serving
dtype it holds 2 bytes a value, for a table of which a step reads a handful of rows.
"""

from __future__ import annotations

import torch
from torch import nn


class GroupedEmbedding(nn.Module):
    """Rows w = q * scale (+ min) per group of the hidden size: int8 q (mins None), or 4-bit
    q in 0..15 (with mins), held two to a byte."""

    def __init__(
        self,
        q: torch.Tensor,  # int8, or uint8 values 0..15 with mins: [vocab, hidden]
        scales: torch.Tensor,  # [vocab, hidden // group]
        mins: torch.Tensor | None,
        dtype: torch.dtype,  # of the rows it returns
    ) -> None:
        super().__init__()
        self.dtype = dtype
        self.four_bit = mins is not None
        if self.four_bit:
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        self.register_buffer("q", q)
        self.register_buffer("scales", scales.float())
        self.register_buffer("mins", None if mins is None else mins.float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.q[ids]
        if self.four_bit:
            q = torch.stack([q & 15, q >> 4], dim=-1).flatten(-2)
        groups = self.scales.shape[1]
        w = q.float().unflatten(-1, (groups, -1)) * self.scales[ids][..., None]
        if self.mins is not None:
            w = w + self.mins[ids][..., None]
        return w.flatten(-2).to(self.dtype)

    def extra_repr(self) -> str:
        kind = "int4" if self.four_bit else "int8"
        return f"{self.q.shape[0]} rows, {self.scales.shape[1]} groups of {kind}"
