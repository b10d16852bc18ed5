"""The attention interface every backend implements (portable torch now, CUDA later)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kamado.kv.cache import KVCache


@dataclass(frozen=True)
class SeqChunk:
    """One sequence's share of a step: `query_len` new tokens ending at `context_len`."""

    query_len: int
    context_len: int  # tokens in the KV cache once this step's tokens are written
    block_table: list[int]


class AttentionBackend(Protocol):
    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> Any:
        """Everything forward() needs for this step, built once and shared by all layers."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        layer: int,
        cache: KVCache,
        metadata: Any,
        kv_stored: bool = False,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write this step's K/V into the cache (unless the caller has: `kv_stored`), then
        attend causally over each sequence."""
        ...


def make_backend(name: str, device: torch.device, sliding_window: int | None) -> AttentionBackend:
    if name == "auto":  # Triton kernels on CUDA, portable torch elsewhere
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from kamado.attention.torch_backend import TorchAttention

        return TorchAttention(device, sliding_window)
    if name == "triton":
        from kamado.attention.triton_backend import TritonAttention

        return TritonAttention(device, sliding_window)
    raise ValueError(f"unknown attention backend {name!r}; available: auto, torch, triton")
