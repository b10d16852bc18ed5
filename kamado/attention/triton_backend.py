"""Attention on CUDA through Triton kernels over the paged cache (see triton_kernels.py).

A step of single-token decodes runs the split-K decode kernel; any step with a longer
chunk runs the extend kernel for every sequence. Decode metadata can live in static
buffers (`DecodeBuffers`) so a captured CUDA graph replays with fresh inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kamado.attention.backend import SeqChunk
from kamado.attention.triton_kernels import decode_attention, extend_attention, store_kv
from kamado.kv.cache import KVCache

# Decode splits the context so that about this many programs run per step; a power of two
# each, at most MAX_SPLITS (one long sequence then still spreads over the GPU).
TARGET_DECODE_PROGRAMS = 256
MAX_SPLITS = 64


def decode_splits(batch: int, num_kv_heads: int) -> int:
    splits = 1
    while splits < MAX_SPLITS and batch * num_kv_heads * splits * 2 <= TARGET_DECODE_PROGRAMS:
        splits *= 2
    return splits


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64; negative: a padding row, nothing written
    block_tables: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32
    # None when every sequence decodes one token (row i is sequence i).
    query_start: torch.Tensor | None  # [S] int32
    query_lens: torch.Tensor | None  # [S] int32
    max_query_len: int
    num_splits: int


@dataclass
class DecodeBuffers:
    """Preallocated decode metadata for up to max_batch sequences, filled in place."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def view(self, batch: int, num_kv_heads: int) -> TritonMetadata:
        return TritonMetadata(
            self.slot_mapping[:batch],
            self.block_tables[:batch],
            self.context_lens[:batch],
            None,
            None,
            1,
            decode_splits(batch, num_kv_heads),
        )


class TritonAttention:
    def __init__(self, device: torch.device, sliding_window: int | None = None) -> None:
        self.device = device
        self.window = sliding_window or 0

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TritonMetadata:
        slot_mapping, query_start = host_step_layout(chunks, block_size)
        width = max(-(-c.context_len // block_size) for c in chunks)
        decode_only = all(c.query_len == 1 for c in chunks)

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(self.device, non_blocking=True)

        return TritonMetadata(
            slot_mapping=torch.tensor(slot_mapping).to(self.device, non_blocking=True),
            block_tables=host_block_tables(chunks, block_size, len(chunks), width).to(
                self.device, non_blocking=True
            ),
            context_lens=ints([c.context_len for c in chunks]),
            query_start=None if decode_only else ints(query_start),
            query_lens=None if decode_only else ints([c.query_len for c in chunks]),
            max_query_len=max(c.query_len for c in chunks),
            num_splits=0,  # chosen at forward, from the KV head count
        )

    def decode_buffers(self, max_batch: int, max_blocks: int) -> DecodeBuffers:
        return DecodeBuffers(
            slot_mapping=torch.full((max_batch,), -1, dtype=torch.long, device=self.device),
            block_tables=torch.zeros(max_batch, max_blocks, dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(max_batch, dtype=torch.int32, device=self.device),
        )

    def fill_decode_buffers(
        self, buffers: DecodeBuffers, chunks: list[SeqChunk], block_size: int, batch: int
    ) -> None:
        """Copy a decode step's metadata into the static buffers, rows past len(chunks)
        padding (nothing written, nothing attended) up to `batch`."""
        n = len(chunks)
        slots, _ = host_step_layout(chunks, block_size)
        # Only the columns in use: kernels never read a block past a context's end.
        width = max(-(-c.context_len // block_size) for c in chunks)
        tables = host_block_tables(chunks, block_size, batch, width)
        lens = torch.zeros(batch, dtype=torch.int32)
        lens[:n] = torch.tensor([c.context_len for c in chunks], dtype=torch.int32)
        slot_mapping = torch.full((batch,), -1, dtype=torch.long)
        slot_mapping[:n] = torch.tensor(slots, dtype=torch.long)
        buffers.slot_mapping[:batch].copy_(slot_mapping, non_blocking=True)
        buffers.block_tables[:batch, :width].copy_(tables, non_blocking=True)
        buffers.context_lens[:batch].copy_(lens, non_blocking=True)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cache: KVCache,
        metadata: TritonMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.format.scaled else None
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, scales, cache.format.qmax)
        if metadata.query_start is None:
            splits = metadata.num_splits or decode_splits(q.shape[0], k_cache.shape[1])
            return decode_attention(
                q, k_cache, v_cache, metadata.block_tables, metadata.context_lens,
                cache.block_size, splits, self.window, scales=scales,
            )  # fmt: skip
        assert metadata.query_lens is not None
        return extend_attention(
            q, k_cache, v_cache, metadata.block_tables, metadata.query_start,
            metadata.query_lens, metadata.context_lens, metadata.max_query_len,
            cache.block_size, self.window, scales=scales,
        )  # fmt: skip


def host_step_layout(chunks: list[SeqChunk], block_size: int) -> tuple[list[int], list[int]]:
    """The cache slot of every new token, and each sequence's first row in the step."""
    slots: list[int] = []
    starts: list[int] = []
    for c in chunks:
        starts.append(len(slots))
        for pos in range(c.context_len - c.query_len, c.context_len):
            slots.append(c.block_table[pos // block_size] * block_size + pos % block_size)
    return slots, starts


def host_block_tables(
    chunks: list[SeqChunk], block_size: int, rows: int, width: int
) -> torch.Tensor:
    """[rows, width] int32 block tables on the host, rows past len(chunks) zero."""
    tables = torch.zeros(rows, width, dtype=torch.int32)
    for i, c in enumerate(chunks):
        blocks = c.block_table[: -(-c.context_len // block_size)]
        tables[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
    return tables
