"""The paged KV cache: per layer, one K and one V tensor of [num_slots, kv_heads, head_dim].

A slot is one token position; block b owns slots [b * block_size, (b + 1) * block_size).
In a quantized format (kv/quant.py) those tensors hold 8-bit codes, and per layer one K and
one V tensor of [num_slots, kv_heads] float32 hold their scales: a scale per slot, or in a
static format the layer's [kv_heads] scales seen through stride 0 over the slots, so that
readers index both alike.
"""

from __future__ import annotations

import torch

from kamado.config import ModelConfig
from kamado.kv.quant import KVFormat, dequantize, quantize


def bytes_per_block(
    config: ModelConfig, block_size: int, dtype: torch.dtype, fmt: KVFormat | None = None
) -> int:
    """Bytes one block takes in every layer, scales included; `fmt` None: stored in dtype."""
    fmt = fmt or KVFormat("auto", dtype, None)
    token_bytes = config.num_kv_heads * config.head_dim * fmt.storage.itemsize  # K or V, a layer
    if fmt.per_token:
        token_bytes += config.num_kv_heads * 4  # a float32 scale per kv head
    return 2 * config.num_layers * block_size * token_bytes


def _bytes(t: torch.Tensor) -> torch.Tensor:
    # 1-byte codes are moved as uint8: CPU torch has no index_copy_ for float8.
    return t.view(torch.uint8) if t.element_size() == 1 else t


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fmt: KVFormat | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype  # what reads of a quantized cache dequantize to
        self.format = fmt or KVFormat("auto", dtype, None)
        shape = (num_blocks * block_size, config.num_kv_heads, config.head_dim)
        storage = self.format.storage
        # Uninitialised: attention reads only slots that were written.
        self.k = [
            torch.empty(shape, dtype=storage, device=device) for _ in range(config.num_layers)
        ]
        self.v = [
            torch.empty(shape, dtype=storage, device=device) for _ in range(config.num_layers)
        ]
        self.k_scale: list[torch.Tensor] = []
        self.v_scale: list[torch.Tensor] = []
        if self.format.static:
            assert self.format.scales is not None, "a static KV format is calibrated first"
            k_static, v_static = self.format.scales.to(device=device, dtype=torch.float32)
            self.k_scale = [s.expand(shape[:2]) for s in k_static]
            self.v_scale = [s.expand(shape[:2]) for s in v_static]
        elif self.format.scaled:
            self.k_scale = [torch.empty(shape[:2], device=device) for _ in self.k]
            self.v_scale = [torch.empty(shape[:2], device=device) for _ in self.v]
        # A block's bytes in each tensor, in the order of its flat form (read_block).
        self._part_bytes = [block_size * t[0].numel() * t.element_size() for t in self._tensors()]
        self.block_bytes = sum(self._part_bytes)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds a slot's own bytes: codes (or values), then scales."""
        if not self.format.per_token:
            return [*self.k, *self.v]
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    def store(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write new K/V [T, kv_heads, head_dim] at `slots` [T], quantizing if the format does."""
        for cache, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            if self.format.scaled:
                static = scales[layer][0] if self.format.static else None  # [kv_heads]
                codes, scale = quantize(x, self.format, static)
                _bytes(cache[layer]).index_copy_(0, slots, _bytes(codes))
                if static is None:
                    scales[layer].index_copy_(0, slots, scale)
            else:
                cache[layer].index_copy_(0, slots, x.to(cache[layer].dtype))

    def read(self, layer: int, where: slice | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at the slots `where` selects: views of the cache when unquantized,
        dequantized copies in self.dtype when quantized."""
        if not self.format.scaled:
            return self.k[layer][where], self.v[layer][where]
        return (
            dequantize(self.k[layer][where], self.k_scale[layer][where], self.dtype),
            dequantize(self.v[layer][where], self.v_scale[layer][where], self.dtype),
        )

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V (and scales) in every layer (copy-on-write when sequences fork)."""
        for t in self._tensors():
            rows = self._by_block(t)
            rows[dst] = rows[src]

    def read_block(self, block: int) -> torch.Tensor:
        """The block's bytes in every layer, codes and scales, as one flat uint8 copy."""
        return self.gather_blocks(torch.tensor([block], device=self.k[0].device))[0]

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Fill a block from what read_block returned."""
        self.scatter_blocks(torch.tensor([block], device=self.k[0].device), data.view(1, -1))

    def gather_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """Blocks' bytes as rows of [len(blocks), block bytes] on the cache's device: per
        tensor (codes, then scales) one gather for all blocks, not a copy per block."""
        out = torch.empty(
            (len(blocks), self.block_bytes), dtype=torch.uint8, device=self.k[0].device
        )
        for t, rows in zip(self._tensors(), self._parts(out), strict=True):
            rows.copy_(self._by_block(t).index_select(0, blocks))
        return out

    def scatter_blocks(self, blocks: torch.Tensor, data: torch.Tensor) -> None:
        """Fill `blocks` from rows of what gather_blocks returned (any device)."""
        if data.shape != (len(blocks), self.block_bytes):
            raise ValueError(
                f"block data holds {tuple(data.shape)} bytes, the cache "
                f"{(len(blocks), self.block_bytes)}"
            )
        data = data.to(self.k[0].device, non_blocking=True)
        for t, rows in zip(self._tensors(), self._parts(data), strict=True):
            self._by_block(t).index_copy_(0, blocks, rows)

    def _by_block(self, t: torch.Tensor) -> torch.Tensor:
        """A slot-indexed tensor viewed as [num_blocks, block_size * rest] bytes."""
        return t.view(torch.uint8).view(self.num_blocks, -1)

    def _parts(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Views of block rows [n, block bytes], one per cache tensor, as [n, its bytes]."""
        parts, offset = [], 0
        for n in self._part_bytes:
            parts.append(rows[:, offset : offset + n])
            offset += n
        return parts
