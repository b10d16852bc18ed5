"""Write small GGUF files the way llama.cpp's converter does, for fast loader tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from kamado.config import ModelConfig
from kamado.models.gguf_loader import gguf_name


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute: HF rotary halves -> interleaved pairs."""
    return (
        w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def write_gguf(
    path: Path,
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    *,
    arch: str | None = None,
    quantized: GGMLQuantizationType | None = None,
    quantized_as: dict[str, GGMLQuantizationType] | None = None,  # by part of a tensor name
    tokens: list[str] | None = None,
    token_types: list[int] | None = None,
    eos: int | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    skip: tuple[str, ...] = (),
) -> None:
    arch = arch or config.architecture
    w = GGUFWriter(path, arch)
    w.add_block_count(config.num_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(config.num_heads)
    w.add_head_count_kv(config.num_kv_heads)
    w.add_key_length(config.head_dim)
    w.add_value_length(config.head_dim)
    w.add_rope_freq_base(config.rope_theta)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    if eos is not None:
        w.add_eos_token_id(eos)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(token_types or [1] * len(tokens))
    for name, tensor in weights.items():
        stored = gguf_name(name)
        if stored in skip:
            continue
        array = tensor.float().numpy()
        if arch == "llama" and (".attn_q." in stored or ".attn_k." in stored):
            heads = config.num_heads if ".attn_q." in stored else config.num_kv_heads
            array = llama_cpp_permute(array, heads)
        qtype = next((t for part, t in (quantized_as or {}).items() if part in stored), quantized)
        if qtype is not None and array.ndim == 2:
            w.add_tensor(stored, quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(stored, np.ascontiguousarray(array))
    for name, array in (extra_tensors or {}).items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
