"""Tiny random-weight transformers models saved as Hugging Face checkpoints, for tests."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def save_tiny_hf_model(
    path: Path, arch: str, weight_std: float | None = None, shard: str = "1GB", **overrides
) -> PreTrainedModel:
    """A 2-layer random `arch` model saved to `path`; returns the transformers model.

    `weight_std` redraws the matrices larger than transformers' default init, which gives
    peaked, non-degenerate greedy outputs (tokens that are not near-ties).
    """
    options = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=arch == "qwen2",
        bos_token_id=1,
        eos_token_id=2,
    )
    if arch == "qwen3":
        options["head_dim"] = 32
    options.update(overrides)
    config = AutoConfig.for_model(arch, **options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if weight_std is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, weight_std)
    model.save_pretrained(path, max_shard_size=shard)
    return model
