"""Portable attention in plain torch: runs anywhere, and is the reference for faster backends."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kamado.attention.backend import SeqChunk
from kamado.kv.cache import KVCache


@dataclass
class TorchAttentionMetadata:
    query_lens: list[int]
    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    # Per sequence, where its K/V lives: a start slot when its blocks are one contiguous
    # run (read as a view, no copy), else the tensor of its slots (gathered).
    kv_slots: list[int | torch.Tensor]
    context_lens: list[int]
    # Per sequence: None (plain causal from the first key, or a single query) or a bool mask.
    masks: list[torch.Tensor | None]
    causal: list[bool]


class TorchAttention:
    def __init__(self, device: torch.device, sliding_window: int | None = None) -> None:
        self.device = device
        self.sliding_window = sliding_window

    def build_metadata(self, chunks: list[SeqChunk], block_size: int) -> TorchAttentionMetadata:
        slot_mapping: list[int] = []
        kv_slots: list[int | torch.Tensor] = []
        masks: list[torch.Tensor | None] = []
        causal: list[bool] = []
        for chunk in chunks:
            n_blocks = -(-chunk.context_len // block_size)
            blocks = chunk.block_table[:n_blocks]
            start = chunk.context_len - chunk.query_len
            for pos in range(start, chunk.context_len):
                slot_mapping.append(blocks[pos // block_size] * block_size + pos % block_size)
            if blocks == list(range(blocks[0], blocks[0] + n_blocks)):
                kv_slots.append(blocks[0] * block_size)
            else:
                table = torch.tensor(blocks, device=self.device)
                offsets = torch.arange(block_size, device=self.device)
                slots = (table[:, None] * block_size + offsets).flatten()
                kv_slots.append(slots[: chunk.context_len])
            mask, is_causal = self._mask(chunk.query_len, chunk.context_len)
            masks.append(mask)
            causal.append(is_causal)
        return TorchAttentionMetadata(
            query_lens=[c.query_len for c in chunks],
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            kv_slots=kv_slots,
            context_lens=[c.context_len for c in chunks],
            masks=masks,
            causal=causal,
        )

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
    ) -> torch.Tensor:
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        k_cache.index_copy_(0, metadata.slot_mapping, k.to(k_cache.dtype))
        v_cache.index_copy_(0, metadata.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        start = 0
        for i, q_len in enumerate(metadata.query_lens):
            where = metadata.kv_slots[i]
            ctx = metadata.context_lens[i]
            if isinstance(where, int):
                keys, values = k_cache[where : where + ctx], v_cache[where : where + ctx]
            else:
                keys, values = k_cache[where], v_cache[where]
            q_seq = q[start : start + q_len]
            if q_len == 1 and metadata.masks[i] is None:
                out[start] = _decode_attention(q_seq[0], keys, values)
            else:
                # [len, heads, dim] -> [heads, len, dim]; kv heads are shared by query groups.
                out[start : start + q_len] = F.scaled_dot_product_attention(
                    q_seq.transpose(0, 1),
                    keys.transpose(0, 1).to(q.dtype),
                    values.transpose(0, 1).to(q.dtype),
                    attn_mask=metadata.masks[i],
                    is_causal=metadata.causal[i],
                    enable_gqa=True,
                ).transpose(0, 1)
            start += q_len
        return out


def _decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query token over its whole context: q [heads, dim], keys/values [ctx, kv_heads, dim].

    Plain batched matmuls per kv head; on CPU this is an order of magnitude faster than
    scaled_dot_product_attention, which falls back to its generic path for one query.
    """
    num_heads, dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.view(num_kv_heads, num_heads // num_kv_heads, dim)
    scores = torch.matmul(grouped, keys.permute(1, 2, 0).to(q.dtype)).float() * dim**-0.5
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values.transpose(0, 1).to(q.dtype)).view(num_heads, dim)
