"""The paged KV cache: per layer, one K and one V tensor of [num_slots, kv_heads, head_dim].

A slot is one token position; block b owns slots [b * block_size, (b + 1) * block_size).
"""

from __future__ import annotations

import torch

from kamado.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * elem


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        # Uninitialised: attention reads only slots that were written.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V in every layer (copy-on-write when sequences fork)."""
        bs = self.block_size
        for cache in (*self.k, *self.v):
            cache[dst * bs : (dst + 1) * bs] = cache[src * bs : (src + 1) * bs]

    def read_block(self, block: int) -> torch.Tensor:
        """The block's K/V in every layer, as one [2, layers, block_size, kv_heads, dim] copy."""
        bs = self.block_size
        k = torch.stack([cache[block * bs : (block + 1) * bs] for cache in self.k])
        v = torch.stack([cache[block * bs : (block + 1) * bs] for cache in self.v])
        return torch.stack([k, v])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        bs = self.block_size
        for layer, (k, v) in enumerate(zip(self.k, self.v, strict=True)):
            k[block * bs : (block + 1) * bs] = data[0, layer]
            v[block * bs : (block + 1) * bs] = data[1, layer]
