"""Attention on CUDA through Triton kernels over the paged cache (see triton_kernels.py).

Single-token rows (decodes) run the split-K decode kernel; longer chunks (prefill, verify)
run the extend kernel, split along the keys too when a step has few query tiles, so a
short chunk over a 100k context still spreads over the GPU. Decode metadata can live in
static buffers (`DecodeBuffers`) so a captured CUDA graph replays with fresh inputs.
"""

from __future__ import annotations

import itertools
from dataclasses import astuple, dataclass

import torch
import triton

from kamado.attention.backend import SeqChunk
from kamado.attention.triton_kernels import (
    MAX_SPLITS,
    decode_attention,
    extend_attention,
    store_kv,
)
from kamado.device_copy import copy_into, to_device
from kamado.kv.cache import KVCache

# Attention splits each context so that about this many programs run per step; a power of
# two each, at most MAX_SPLITS (one long sequence then still spreads over the GPU).
TARGET_PROGRAMS = 256
TABLE_WIDTH_MULTIPLE = 16
# An extend split covers at least this many keys: shorter ones cost more to merge than
# they save.
MIN_SPLIT_KEYS = 1024


def decode_splits(batch: int, num_kv_heads: int) -> int:
    """Fixed per captured batch size, so it cannot depend on the context lengths."""
    return _splits(batch * num_kv_heads, MAX_SPLITS)


def extend_splits(programs: int, longest_context: int) -> int:
    return _splits(programs, min(MAX_SPLITS, longest_context // MIN_SPLIT_KEYS))


def _splits(programs: int, most: int) -> int:
    splits = 1
    while splits * 2 <= most and programs * splits * 2 <= TARGET_PROGRAMS:
        splits *= 2
    return splits


@dataclass(frozen=True)
class ExtendTile:
    """An extend kernel's tile (query rows x keys) and launch shape: each its own kernel."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# A short chunk gets a small tile rather than a mostly empty one. Long chunks get 256 x 128
# with 8 warps: the fastest measured on an H200 at 8k and 128k contexts, 1.08x and 1.26x
# the 128 x 64 tile (scripts/sweep_extend.py, bench/results/2026-11-30-h200-extend-sweep-2.txt).
EXTEND_TILES = (
    *(ExtendTile(rows, 64, 4, 3) for rows in (16, 32, 64, 128)),
    ExtendTile(256, 128, 8, 2),
)


def extend_tile(max_query_len: int) -> ExtendTile:
    rows = triton.next_power_of_2(max_query_len)
    return next((t for t in EXTEND_TILES if t.block_m >= rows), EXTEND_TILES[-1])


def extend_heads_per_program(max_query_len: int, num_heads: int, num_kv_heads: int) -> int:
    """A GQA group's heads share an extend program (its tile's rows) where the chunk's
    queries times the group fit one tile: a short chunk over a long context then loads each
    key once for the group, not once per head. At 120k keys on the H200, a 16-token chunk's
    extend took 415 us a layer with a head a program, 4x the time its keys take to read.
    Longer chunks fill tiles of one head, and the loads come out the same either way."""
    group = num_heads // num_kv_heads
    return group if max_query_len * group <= EXTEND_TILES[-1].block_m else 1


def extend_launch(
    max_query_len: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    keys: int,
    heads_per_program: int | None = None,
) -> tuple[ExtendTile, int, int]:
    """How a step's extend kernel runs: its tile, its splits along the `keys` (so a few
    programs still fill the GPU), and the heads a program takes (as
    extend_heads_per_program picks, unless given)."""
    heads = heads_per_program or extend_heads_per_program(max_query_len, num_heads, num_kv_heads)
    tile = extend_tile(max_query_len * heads)
    tiles = -(-max_query_len // (tile.block_m // heads)) * num_seqs
    return tile, extend_splits(tiles * num_heads // heads, keys), heads


@dataclass
class DecodeRows:
    """Single-token rows: row i of `rows` (every row, in order, when None) is sequence i."""

    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32; 0 for a padding row
    rows: torch.Tensor | None  # [B] int64 rows of the step's q
    num_splits: int  # 0: chosen at forward, from the KV head count


@dataclass
class ExtendRows:
    """Sequences with longer chunks, their queries where query_start says in the step's q."""

    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_start: torch.Tensor  # [S] int32
    query_lens: torch.Tensor  # [S] int32
    context_lens: torch.Tensor  # [S] int32
    max_query_len: int
    longest_context: int


@dataclass
class TritonMetadata:
    slot_mapping: torch.Tensor  # [T] int64; negative: a padding row, nothing written
    decode: DecodeRows | None
    extend: ExtendRows | None


@dataclass
class DecodeBuffers:
    """Preallocated decode metadata for up to max_batch sequences, filled in place."""

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor

    def view(self, batch: int, num_kv_heads: int) -> TritonMetadata:
        rows = DecodeRows(
            self.block_tables[:batch],
            self.context_lens[:batch],
            None,
            decode_splits(batch, num_kv_heads),
        )
        return TritonMetadata(self.slot_mapping[:batch], rows, None)


class TritonAttention:
    def __init__(self, device: torch.device, sliding_window: int | None = None) -> None:
        self.device = device
        self.window = sliding_window or 0

    @torch.inference_mode()
    def compile_kernels(self, cache: KVCache, num_heads: int, dtype: torch.dtype) -> None:
        """Compile now every kernel variant a step can need: the extend kernel for each tile
        size (with a head a program, and with a GQA group) and the decode kernel, each with
        and without splits, and the K/V store. Compiled on first use instead, each stalled
        a step for 0.6-2.5 s on the H200. They run on a dummy sequence that writes nothing
        and reads block 0."""
        k_cache, v_cache = cache.k[0], cache.v[0]
        scales = (cache.k_scale[0], cache.v_scale[0]) if cache.format.scaled else None
        num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads

        def ints(value: int) -> torch.Tensor:
            return torch.tensor([value], dtype=torch.int32, device=self.device)

        # Every column block 0, as many as the longest dummy context (the largest tile) needs.
        width = -(-EXTEND_TILES[-1].block_m // cache.block_size)
        width = -(-width // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
        table = torch.zeros(1, width, dtype=torch.int32, device=self.device)
        kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=self.device)
        nowhere = torch.full((1,), -1, dtype=torch.long, device=self.device)
        store_kv(kv, kv, k_cache, v_cache, nowhere, scales, cache.format.qmax)
        for splits in (1, 2):
            q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=self.device)
            decode_attention(
                q, k_cache, v_cache, table, ints(1), cache.block_size, splits, self.window,
                scales=scales,
            )  # fmt: skip
            for tile, heads in itertools.product(EXTEND_TILES, {1, group}):
                rows = tile.block_m // heads
                q = torch.zeros(rows, num_heads, head_dim, dtype=dtype, device=self.device)
                extend_attention(
                    q, k_cache, v_cache, table, ints(0), ints(rows), ints(rows),
                    rows, cache.block_size, self.window, *astuple(tile), scales=scales,
                    num_splits=splits, heads_per_program=heads,
                )  # fmt: skip
        torch.cuda.synchronize(self.device)

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TritonMetadata:
        slot_mapping, query_start = host_step_layout(chunks, block_size)
        decodes = [i for i, c in enumerate(chunks) if c.query_len == 1]
        extends = [i for i, c in enumerate(chunks) if c.query_len > 1]

        def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return to_device(values, self.device, dtype)

        def tables(picked: list[SeqChunk]) -> torch.Tensor:
            width = max(-(-c.context_len // block_size) for c in picked)
            # A multiple of 16: Triton compiles a kernel again for each new divisibility of
            # an int argument, and the row stride is one (likely the 0.6-2.5 s steps seen in
            # mixed steps on the H200; not yet rerun there).
            width = -(-width // TABLE_WIDTH_MULTIPLE) * TABLE_WIDTH_MULTIPLE
            host = host_block_tables(picked, block_size, len(picked), width)
            return to_device(host, self.device, torch.int32)

        decode = extend = None
        if decodes:
            picked = [chunks[i] for i in decodes]
            decode = DecodeRows(
                block_tables=tables(picked),
                context_lens=ints([c.context_len for c in picked]),
                # Every row a decode: the rows are the sequences, in order.
                rows=None if not extends else ints([query_start[i] for i in decodes], torch.long),
                num_splits=0,
            )
        if extends:
            picked = [chunks[i] for i in extends]
            extend = ExtendRows(
                block_tables=tables(picked),
                query_start=ints([query_start[i] for i in extends]),
                query_lens=ints([c.query_len for c in picked]),
                context_lens=ints([c.context_len for c in picked]),
                max_query_len=max(c.query_len for c in picked),
                longest_context=max(c.context_len for c in picked),
            )
        return TritonMetadata(ints(slot_mapping, torch.long), decode, extend)

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
        copy_into(buffers.slot_mapping[:batch], slot_mapping)
        copy_into(buffers.block_tables[:batch, :width], tables)
        copy_into(buffers.context_lens[:batch], lens)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cache: KVCache,
        metadata: TritonMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.format.scaled else None
        if not kv_stored:
            store_kv(k, v, k_cache, v_cache, metadata.slot_mapping, scales, cache.format.qmax)
        out = None
        if (ext := metadata.extend) is not None:
            keys = ext.longest_context
            if self.window:
                keys = min(keys, self.window + ext.max_query_len)
            tile, splits, heads = extend_launch(
                ext.max_query_len, ext.query_lens.shape[0], q.shape[1], k_cache.shape[1], keys
            )
            out = extend_attention(
                q, k_cache, v_cache, ext.block_tables, ext.query_start, ext.query_lens,
                ext.context_lens, ext.max_query_len, cache.block_size, self.window,
                *astuple(tile), scales=scales, num_splits=splits, heads_per_program=heads,
            )  # fmt: skip
        if (dec := metadata.decode) is not None:
            rows = q if dec.rows is None else q[dec.rows]
            splits = dec.num_splits or decode_splits(rows.shape[0], k_cache.shape[1])
            decoded = decode_attention(
                rows, k_cache, v_cache, dec.block_tables, dec.context_lens,
                cache.block_size, splits, self.window, scales=scales,
            )  # fmt: skip
            if out is None:
                return decoded
            out.index_copy_(0, dec.rows, decoded)
        assert out is not None
        return out


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
