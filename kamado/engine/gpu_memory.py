"""Sizing the KV pool on a GPU: weights first, then room for the largest step's
activations, then the pool from what is left under the user's fraction of the card."""

from __future__ import annotations

import torch

from kamado.config import EngineConfig, ModelConfig

# Headroom over the counted activations: allocator rounding, cuBLAS workspaces, the
# decode graphs' memory pool, rope tables.
ACTIVATION_SLACK = 2


def step_activation_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Peak activations of a step of max_num_batched_tokens tokens, plus its logits."""
    elem = torch.tensor([], dtype=dtype).element_size()
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    # Live at once: hidden, residual and normed rows, qkv, attention output, gate/up and
    # its activated half.
    per_token = 3 * model.hidden_size + (q + 2 * kv) + q + 3 * model.intermediate_size
    logits = config.max_num_seqs * model.vocab_size * 4 * 2  # float32, and a gathered copy
    return ACTIVATION_SLACK * (config.max_num_batched_tokens * per_token * elem + logits)


def cuda_kv_budget(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes for the KV pool, called once the weights are on the card."""
    free, total = torch.cuda.mem_get_info(torch.device(config.device))
    in_use = total - free  # the weights, and whatever else already holds the card
    budget = config.gpu_memory_fraction * total - in_use
    budget -= step_activation_bytes(config, model, dtype)
    if budget <= 0:
        raise ValueError(
            f"no GPU memory left for the KV cache: {in_use / 2**30:.1f} GiB in use of "
            f"{total / 2**30:.1f} GiB with gpu_memory_fraction={config.gpu_memory_fraction}"
        )
    return int(budget)
