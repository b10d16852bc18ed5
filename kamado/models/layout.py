"""The weight layout every loader produces: Hugging Face tensor names and [out, in] shapes.

This is the contract with the model code: whatever the file format, load_weights returns
exactly these names with exactly these shapes, or raises.
"""

from __future__ import annotations

import math

from kamado.config import ModelConfig
from kamado.models.errors import ModelLoadError


def expected_weights(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name the model needs, with its shape, in load order."""
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q_out, kv_out = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, h)
        if config.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if config.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = (d,)
            shapes[p + "self_attn.k_norm.weight"] = (d,)
        shapes[p + "self_attn.o_proj.weight"] = (h, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def check_shape(name: str, shape: tuple[int, ...], expected: tuple[int, ...], where: str) -> None:
    if tuple(shape) != tuple(expected):
        raise ModelLoadError(
            f"{where}: tensor {name} has shape {list(shape)}, expected {list(expected)} "
            "from the model config"
        )


def missing(name: str, where: str, stored_as: str | None = None) -> ModelLoadError:
    also = f" (stored as {stored_as})" if stored_as and stored_as != name else ""
    return ModelLoadError(f"{where}: tensor {name}{also} is missing")


def parameter_count(config: ModelConfig) -> int:
    return sum(math.prod(shape) for shape in expected_weights(config).values())
