"""Portable attention in plain torch: runs anywhere, and is the reference for faster backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kamado.attention.backend import SeqChunk
from kamado.kv.cache import KVCache

# Single-token decodes with contexts up to this long run as one padded batch (their K/V
# gathered); a longer one reads its own K/V as a view, uncopied, and pads nobody else.
BATCHED_DECODE_MAX_CONTEXT = 512
# Chunks of up to this many queries use plain matmuls, by the dtype they run in: on CPU,
# scaled_dot_product_attention with a mask takes its generic path and is slower for a few
# queries against a long context. In float32 on this 2-core CPU, plain matmuls were faster
# up to 128 queries (24 queries over 7k keys: 8.9 ms a layer against 46) and level at 128
# over 16k (`python scripts/attention_cost.py --queries 16 32 96 128 192`); other dtypes
# keep the bound measured before for one to a few queries.
MATMUL_ATTENTION_MAX_QUERIES = {torch.float32: 128}
MATMUL_ATTENTION_MAX_QUERIES_OTHER = 16
# A chunk's queries attend in blocks whose float32 scores take at most this many bytes: in
# one piece, 128 queries over 16k keys made 117 MB of scores, out of the CPU's caches, and
# took 261 ms a layer where blocks took 122 (qwen2.5-coder-0.5b shapes, this 2-core CPU;
# `python scripts/attention_cost.py --contexts 4096 16384 --queries 16 32 96 128`,
# bench/results/2026-12-01-cpu-attention-cost-blocked.txt).
SCORE_BLOCK_BYTES = 16 << 20


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
    # The sequences attended one by one: (first row, query_len, context_len, where, mask,
    # causal). `where` is a start slot when the blocks form one contiguous run (read as a
    # view), else the tensor of slots (gathered); mask is None for plain causal attention.
    singles: list[tuple[int, int, int, int | torch.Tensor, torch.Tensor | None, bool]]


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
            and self._mask(1, c.context_len)[0] is None
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
            mask, causal = self._mask(chunk.query_len, chunk.context_len)
            singles.append((rows[i], chunk.query_len, chunk.context_len, where, mask, causal))
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

    def _mask(self, q_len: int, ctx: int) -> tuple[torch.Tensor | None, bool]:
        window = self.sliding_window
        if window is None or window >= ctx:
            if q_len == 1:
                return None, False  # one query sees every key
            if q_len == ctx:
                return None, True  # plain causal prefill
        # Query i sits at position ctx - q_len + i and sees keys (pos - window, pos].
        q_pos = torch.arange(ctx - q_len, ctx, device=self.device)[:, None]
        k_pos = torch.arange(ctx, device=self.device)[None, :]
        mask = k_pos <= q_pos
        if window is not None:
            mask &= k_pos > q_pos - window
        return mask, False

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
        for row, q_len, ctx, where, mask, causal in metadata.singles:
            span = slice(where, where + ctx) if isinstance(where, int) else where
            keys, values = cache.read(layer, span)
            q_seq = q[row : row + q_len]
            most = MATMUL_ATTENTION_MAX_QUERIES.get(q.dtype, MATMUL_ATTENTION_MAX_QUERIES_OTHER)
            if q_len <= most:
                if causal:  # a short prompt attended as a whole: spell out its causal mask
                    mask = torch.ones(q_len, ctx, dtype=torch.bool, device=q.device).tril()
                out[row : row + q_len] = chunk_attention(q_seq, keys, values, mask)
                continue
            # [len, heads, dim] -> [heads, len, dim]; kv heads are shared by query groups.
            out[row : row + q_len] = F.scaled_dot_product_attention(
                q_seq.transpose(0, 1),
                keys.transpose(0, 1).to(q.dtype),
                values.transpose(0, 1).to(q.dtype),
                attn_mask=mask,
                is_causal=causal,
                enable_gqa=True,
            ).transpose(0, 1)
        return out


def chunk_attention(
    q: torch.Tensor,  # [Q, heads, dim], one sequence's queries
    keys: torch.Tensor,  # [L, kv_heads, dim]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # [Q, L], True where a query may attend
) -> torch.Tensor:  # [Q, heads, dim]
    """One sequence's chunk through matmul_attention, in blocks of queries whose scores
    fit SCORE_BLOCK_BYTES: the cost then grows in proportion to the queries."""
    n_q, num_heads, _ = q.shape
    block = max(1, SCORE_BLOCK_BYTES // (num_heads * keys.shape[0] * 4))
    out = torch.empty_like(q)
    for start in range(0, n_q, block):
        rows = slice(start, min(start + block, n_q))
        rows_mask = None if mask is None else mask[None, rows]
        out[rows] = matmul_attention(q[None, rows], keys[None], values[None], rows_mask)[0]
    return out


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
