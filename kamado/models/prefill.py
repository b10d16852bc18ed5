"""One prompt through the model whole, outside the engine's scheduler: for scoring
(`surgery check`) and for calibrating a static KV format (kv/calibration.py)."""

from __future__ import annotations

import torch

from kamado.attention.backend import AttentionBackend, SeqChunk
from kamado.kv.cache import KVCache
from kamado.models.rope import RotaryEmbedding
from kamado.models.transformer import ForwardPass, StepContext


def prefill_hidden(
    forward: ForwardPass,
    rope: RotaryEmbedding,
    backend: AttentionBackend,
    cache: KVCache,
    ids: list[int],
) -> torch.Tensor:
    """Final hidden states at every position of `ids`, run as one chunk whose K/V go to the
    first blocks of `cache` (which must hold them)."""
    block = cache.block_size
    blocks = -(-len(ids) // block)
    assert blocks <= cache.num_blocks, f"{len(ids)} tokens need {blocks} blocks"
    metadata = backend.build_metadata([SeqChunk(len(ids), len(ids), list(range(blocks)))], block)
    rope.reserve(len(ids))
    device = cache.k[0].device
    ctx = StepContext(rope, backend, cache, metadata)
    return forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
