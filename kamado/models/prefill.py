"""One prompt through the model whole, outside the engine's scheduler and its KV pool: for
scoring (`surgery check`) and for calibrating a static KV format (kv/calibration.py)."""

from __future__ import annotations

import torch

from kamado.attention.backend import AttentionBackend, SeqChunk
from kamado.config import ModelConfig
from kamado.kv.cache import KVCache
from kamado.kv.quant import KVFormat
from kamado.models.rope import RotaryEmbedding
from kamado.models.transformer import ForwardPass, StepContext


def prefill_alone(
    forward: ForwardPass,
    rope: RotaryEmbedding,
    backend: AttentionBackend,
    ids: list[int],
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int,
    fmt: KVFormat | None = None,
) -> tuple[torch.Tensor, KVCache]:
    """Final hidden states at every position of `ids`, run as one chunk into a KV cache of
    their own (in `fmt`; None: the model's dtype), and that cache."""
    blocks = -(-len(ids) // block_size)
    cache = KVCache(config, blocks, block_size, dtype, device, fmt)
    metadata = backend.build_metadata(
        [SeqChunk(len(ids), len(ids), list(range(blocks)))], block_size
    )
    rope.reserve(len(ids))
    ctx = StepContext(rope, backend, cache, metadata)
    hidden = forward(torch.tensor(ids, device=device), torch.arange(len(ids), device=device), ctx)
    return hidden, cache
