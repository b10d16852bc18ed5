"""Portable attention in plain torch: runs anywhere, and is the reference for faster backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kamado.attention.backend import SeqChunk
from kamado.kv.cache import KVCache

# Single-token decodes with contexts up to this long run as one padded batch (their K/V
# gathered); a longer one reads its own K/V as a view, uncopied, and pads nobody else.
BATCHED_DECODE_MAX_CONTEXT = 512
# A chunk of up to this many queries attends through plain matmuls, its scores in one
# piece; a longer one tile by tile (`tiled_attention`). On this 2-core CPU in bf16
# (qwen2.5-coder-0.5b shapes), over 16k keys, the matmuls took 2.4 ms a layer for 2 queries
# and 5.3 for 8 against the tiles' 3.4 and 5.8; level at 16; at 96, 156 against 52
# (`python scripts/attention_cost.py`, bench/results/2026-12-04-cpu-attention-cost-tiles.txt).
MATMUL_ATTENTION_MAX_QUERIES = 8
# Tiles: up to QUERY_TILE queries against as many keys as keep their float32 scores within
# SCORE_TILE_BYTES, and no fewer than MIN_KEY_TILE (at 128 queries: 512 keys, 3.7 MB).
QUERY_TILE = 128
SCORE_TILE_BYTES = 2 << 20
MIN_KEY_TILE = 512


@dataclass
class DecodeBatch:
    """Decodes attended together: their rows in the step, their slots padded to one length."""

    rows: torch.Tensor  # [B] positions of the decode tokens among the step's tokens
    slots: torch.Tensor  # [B, L] cache slots of each sequence's context, padded with 0
    valid: torch.Tensor  # [B, L] which of those slots are real


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    decodes: DecodeBatch | None
    # The sequences attended one by one: (first row, query_len, context_len, where, mask).
    # `where` is a start slot when the blocks form one contiguous run (read as a view), else
    # the tensor of slots (gathered). mask: which keys each query sees, for chunks attended
    # through plain matmuls where not every query sees every key; None otherwise (tiles
    # work out what each query sees from the positions).
    singles: list[tuple[int, int, int, int | torch.Tensor, torch.Tensor | None]]


class TorchAttention:
    def __init__(self, device: torch.device, sliding_window: int | None = None) -> None:
        self.device = device
        self.sliding_window = sliding_window

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TorchAttentionMetadata:
        slot_mapping: list[int] = []
        block_lists: list[list[int]] = []
        rows = [0]
        for chunk in chunks:
            blocks = chunk.block_table[: -(-chunk.context_len // block_size)]
            block_lists.append(blocks)
            for pos in range(chunk.context_len - chunk.query_len, chunk.context_len):
                slot_mapping.append(blocks[pos // block_size] * block_size + pos % block_size)
            rows.append(rows[-1] + chunk.query_len)
        plain_decodes = [
            i
            for i, c in enumerate(chunks)
            if c.query_len == 1
            and c.context_len <= BATCHED_DECODE_MAX_CONTEXT
            and self._mask(1, c.context_len) is None
        ]
        longest = max((chunks[i].context_len for i in plain_decodes), default=0)
        batch_decodes = len(plain_decodes) > 1
        singles = []
        for i, chunk in enumerate(chunks):
            if batch_decodes and i in plain_decodes:
                continue
            blocks = block_lists[i]
            if blocks == list(range(blocks[0], blocks[0] + len(blocks))):
                where: int | torch.Tensor = blocks[0] * block_size
            else:
                where = self._slots(blocks, chunk.context_len, block_size)
            mask = None
            if chunk.query_len <= MATMUL_ATTENTION_MAX_QUERIES:
                mask = self._mask(chunk.query_len, chunk.context_len)
            singles.append((rows[i], chunk.query_len, chunk.context_len, where, mask))
        decodes = None
        if batch_decodes:
            slots = torch.zeros(len(plain_decodes), longest, dtype=torch.long, device=self.device)
            for b, i in enumerate(plain_decodes):
                ctx = chunks[i].context_len
                slots[b, :ctx] = self._slots(block_lists[i], ctx, block_size)
            lengths = torch.tensor([chunks[i].context_len for i in plain_decodes])
            decodes = DecodeBatch(
                rows=torch.tensor([rows[i] for i in plain_decodes], device=self.device),
                slots=slots,
                valid=(torch.arange(longest)[None, :] < lengths[:, None]).to(self.device),
            )
        return TorchAttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            decodes=decodes,
            singles=singles,
        )

    def _slots(self, blocks: list[int], context_len: int, block_size: int) -> torch.Tensor:
        table = torch.tensor(blocks, device=self.device)
        offsets = torch.arange(block_size, device=self.device)
        return (table[:, None] * block_size + offsets).flatten()[:context_len]

    def _mask(self, q_len: int, ctx: int) -> torch.Tensor | None:
        """Which of the `ctx` keys each of the context's last `q_len` queries sees; None
        when every query sees every key (one query, within the window)."""
        if q_len == 1 and (self.sliding_window is None or self.sliding_window >= ctx):
            return None
        return visible_keys(
            torch.arange(ctx - q_len, ctx, device=self.device),
            torch.arange(ctx, device=self.device),
            self.sliding_window,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        cache: KVCache,
        metadata: TorchAttentionMetadata,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not kv_stored:
            cache.store(layer, metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        if (d := metadata.decodes) is not None:
            keys, values = cache.read(layer, d.slots)
            out[d.rows] = matmul_attention(q[d.rows, None], keys, values, d.valid[:, None, :])[:, 0]
        for row, q_len, ctx, where, mask in metadata.singles:
            span = slice(where, where + ctx) if isinstance(where, int) else where
            keys, values = cache.read(layer, span)
            q_seq = q[row : row + q_len]
            if q_len <= MATMUL_ATTENTION_MAX_QUERIES:
                rows_mask = None if mask is None else mask[None]
                out[row : row + q_len] = matmul_attention(
                    q_seq[None], keys[None], values[None], rows_mask
                )[0]
            else:
                out[row : row + q_len] = tiled_attention(q_seq, keys, values, self.sliding_window)
        return out


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q, K] mask of the keys at `k_pos` each query at `q_pos` sees: those at or before
    it, and within the sliding window when there is one."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def tiled_attention(
    q: torch.Tensor,  # [Q, heads, dim]: the queries of the context's last Q positions
    keys: torch.Tensor,  # [L, kv_heads, dim], the whole context's
    values: torch.Tensor,
    window: int | None,
) -> torch.Tensor:  # [Q, heads, dim]
    """One sequence's chunk over its context, tile by tile in float32, the softmax kept
    running across a tile row's key tiles (flash attention's way), so no score tensor
    outgrows a tile: in one piece, or in blocks of queries each over every key, the scores
    of a long context left the CPU's caches, and scaled_dot_product_attention with a mask
    takes a generic path on CPU (96 queries over 16k keys in bf16: 52 ms a layer in tiles,
    182 through it; see MATMUL_ATTENTION_MAX_QUERIES). Key tiles that no query of a tile
    row sees are skipped."""
    n_q, num_heads, dim = q.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k_heads, v_heads = keys.transpose(0, 1), values.transpose(0, 1)  # [kv_heads, L, dim]
    out = torch.empty_like(q)
    for q_start in range(0, n_q, QUERY_TILE):
        n = min(QUERY_TILE, n_q - q_start)
        # The tile row's queries, grouped by the kv head they share, scaled once here.
        rows = (q[q_start : q_start + n].float() * dim**-0.5).view(n, num_kv_heads, group, dim)
        rows = rows.permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, dim)
        key_tile = max(MIN_KEY_TILE, SCORE_TILE_BYTES // (4 * num_heads * n))
        first = ctx - n_q + q_start  # the tile row's query positions: first..last
        last = first + n - 1
        q_pos = torch.arange(first, last + 1, device=q.device)
        start = 0 if window is None else max(0, first - window + 1)
        running: _RunningSoftmax | None = None
        for k_start in range(start, last + 1, key_tile):
            k_end = min(k_start + key_tile, last + 1)
            scores = torch.matmul(rows, k_heads[:, k_start:k_end].float().transpose(1, 2))
            if k_end - 1 > first or (window is not None and k_start <= last - window):
                hidden = ~visible_keys(q_pos, torch.arange(k_start, k_end, device=q.device), window)
                scores.view(num_kv_heads, group, n, -1).masked_fill_(hidden, float("-inf"))
            tile = _RunningSoftmax.of_tile(scores, v_heads[:, k_start:k_end])
            running = tile if running is None else running.merge(tile)
        assert running is not None  # every query sees at least its own key
        o = running.total_out / running.total
        out[q_start : q_start + n] = (
            o.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
        )
    return out


@dataclass
class _RunningSoftmax:
    """A softmax over key tiles seen so far, per query row: the largest score, the sum of
    exp(score - largest), and the values weighted by those exps (float32)."""

    top: torch.Tensor  # [kv_heads, rows, 1]; -inf for a row that has seen no key yet
    total: torch.Tensor  # [kv_heads, rows, 1]
    total_out: torch.Tensor  # [kv_heads, rows, dim]

    @classmethod
    def of_tile(cls, scores: torch.Tensor, values: torch.Tensor) -> _RunningSoftmax:
        top = scores.amax(dim=-1, keepdim=True)
        # A row that sees no key of this tile has top -inf; subtracting 0 keeps its exps 0.
        weights = scores.sub_(top.nan_to_num(neginf=0.0)).exp_()
        return cls(top, weights.sum(dim=-1, keepdim=True), torch.matmul(weights, values.float()))

    def merge(self, other: _RunningSoftmax) -> _RunningSoftmax:
        top = torch.maximum(self.top, other.top)
        shift = top.nan_to_num(neginf=0.0)  # rows of neither tile's keys: weights 0
        mine, theirs = torch.exp(self.top - shift), torch.exp(other.top - shift)
        return _RunningSoftmax(
            top,
            self.total * mine + other.total * theirs,
            self.total_out * mine + other.total_out * theirs,
        )


def matmul_attention(
    q: torch.Tensor,  # [B, Q, heads, dim]
    keys: torch.Tensor,  # [B, L, kv_heads, dim]
    values: torch.Tensor,
    mask: torch.Tensor | None = None,  # [B, Q, L], True where a query may attend
) -> torch.Tensor:  # [B, Q, heads, dim]
    """Attention as plain batched matmuls, the queries of each kv head's group side by side."""
    batch, n_q, num_heads, dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.view(batch, n_q, num_kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, num_kv_heads, group * n_q, dim)
    keys = keys.to(q.dtype).transpose(1, 2)  # [B, kv_heads, L, dim], a strided view
    if q.dtype != torch.float32 or batch > 1:
        # Copied head-major, the keys multiply faster than the strided view in bf16 (one
        # query over 16k keys: 1.3 ms a layer instead of 2.3 on this 2-core CPU) and in a
        # batch; a single float32 product reads the view directly and is faster without.
        keys = keys.contiguous()
    scores = torch.matmul(grouped, keys.transpose(2, 3)).float() * dim**-0.5
    if mask is not None:
        scores = scores.view(batch, num_kv_heads, group, n_q, -1)
        scores = scores.masked_fill(~mask[:, None, None], float("-inf"))
        scores = scores.view(batch, num_kv_heads, group * n_q, -1)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.permute(0, 2, 1, 3).to(q.dtype))
    out = out.view(batch, num_kv_heads, group, n_q, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, n_q, num_heads, dim)
