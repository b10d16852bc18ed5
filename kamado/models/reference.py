"""The transformers model equivalent to a ModelConfig plus weights: the reference our own
model code is tested against (never used to serve)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kamado.config import ModelConfig

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def transformers_config(config: ModelConfig) -> PretrainedConfig:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    rope = {"rope_type": "default", **(config.rope_scaling or {}), "rope_theta": config.rope_theta}
    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters=rope,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids) or None,
    )
    window = config.sliding_window
    arch = config.architecture
    if arch == "llama":
        return LlamaConfig(**common, head_dim=config.head_dim, attention_bias=False)
    if arch == "mistral":
        return MistralConfig(**common, head_dim=config.head_dim, sliding_window=window)
    qwen_window = dict(use_sliding_window=window is not None, sliding_window=window)
    if arch == "qwen3":
        return Qwen3Config(**common, **qwen_window, max_window_layers=0, head_dim=config.head_dim)
    hf = Qwen2Config(**common, **qwen_window, max_window_layers=0)
    hf.head_dim = config.head_dim  # Qwen2Config has no head_dim argument; the model reads the attr
    return hf


def transformers_model(
    config: ModelConfig, weights: dict[str, torch.Tensor], attn_implementation: str = "eager"
) -> PreTrainedModel:
    """A transformers CausalLM holding exactly `weights` (strict: every name must match)."""
    from transformers import AutoModelForCausalLM

    hf_config = transformers_config(config)
    hf_config._attn_implementation = attn_implementation
    dtype = next(iter(weights.values())).dtype
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.load_state_dict(weights, strict=not config.tie_word_embeddings)
    if config.tie_word_embeddings:
        model.tie_weights()
        unexpected = set(weights) - set(model.state_dict())
        missing = set(model.state_dict()) - set(weights) - {"lm_head.weight"}
        if unexpected or missing:
            raise ValueError(f"weights do not fit: unexpected {unexpected}, missing {missing}")
    return model.eval()
