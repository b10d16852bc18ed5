"""ModelConfig and dequantized weights (under HF names) from a GGUF file."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from kamado.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kamado.models.errors import ModelLoadError
from kamado.models.gguf_reader import GGUFFile
from kamado.models.layout import check_shape, expected_weights, missing

# Token texts that end a turn even when the file names a different eos (llama.cpp does the
# same): Qwen's <|endoftext|> beside <|im_end|>, Llama 3's <|eot_id|>.
_EOG_TEXTS = {"<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>"}
_CONTROL = 3  # llama.cpp token type

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")

# Architectures whose q/k rows llama.cpp's converter permuted (interleaved rotary halves).
_PERMUTED = {"llama"}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name for a Hugging Face one."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER_RE.fullmatch(hf_name)
    if not m or m[2] not in _LAYER_NAMES:
        raise KeyError(hf_name)
    return f"blk.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"


def gguf_model_config(path: Path) -> ModelConfig:
    gf = GGUFFile(path, string_arrays={"tokenizer.ggml.tokens"})
    md, arch = gf.metadata, gf.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported architecture {arch!r}; "
            f"kamado supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def key(name: str, default: object = None) -> object:
        value = md.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata key {arch}.{name} is missing")
        return value

    if "token_embd.weight" not in gf.tensors:
        raise missing("model.embed_tokens.weight", str(path), "token_embd.weight")
    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rope_theta = float(key("rope.freq_base", 10000.0))
    window = md.get(f"{arch}.attention.sliding_window")
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=gf.tensors["token_embd.weight"].shape[0],
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=_rope_scaling(gf, arch, head_dim, rope_theta),
            max_position_embeddings=int(key("context_length", 4096)),
            qkv_bias="blk.0.attn_q.bias" in gf.tensors,
            qk_norm="blk.0.attn_q_norm.weight" in gf.tensors,
            tie_word_embeddings="output.weight" not in gf.tensors,
            sliding_window=int(window) if window else None,
            bos_token_id=_int_or_none(md.get("tokenizer.ggml.bos_token_id")),
            eos_token_ids=_eos_token_ids(md),
        )
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from e


def gguf_weights(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    """Dequantize every expected tensor straight to dtype/device, a few at a time."""
    return dict(iter_gguf_weights(path, config, dtype, device))


def iter_gguf_weights(
    path: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    skip: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """gguf_weights one tensor at a time, in order; names in `skip` are not read."""
    gf = GGUFFile(path)
    expected = expected_weights(config)
    for name, shape in expected.items():  # check everything before the slow part
        stored = gguf_name(name)
        if stored not in gf.tensors:
            raise missing(name, str(path), stored)
        check_shape(name, gf.tensors[stored].shape, shape, str(path))

    def convert(name: str) -> torch.Tensor:
        stored = gguf_name(name)
        try:
            array = gf.dequantize(stored)
        except NotImplementedError as e:  # a quant type gguf-py cannot dequantize
            raise ModelLoadError(f"{path}: tensor {stored}: {e}") from e
        if heads := permuted_heads(gf.architecture, stored, config):
            array = unpermute_rows(array, heads)
        return torch.from_numpy(array).to(device=device, dtype=dtype)

    # numpy releases the GIL inside dequantization: threads give ~2x on two cores. Only a
    # window of float32 temporaries is alive at once.
    names = [n for n in expected if n not in skip]
    workers = min(8, os.cpu_count() or 1)
    window = 4 * workers
    with ThreadPoolExecutor(workers) as pool:
        for start in range(0, len(names), window):
            chunk = names[start : start + window]
            yield from zip(chunk, pool.map(convert, chunk), strict=True)


def permuted_heads(architecture: str, stored: str, config: ModelConfig) -> int | None:
    """The head count to undo llama.cpp's q/k row permute with, or None if not permuted."""
    if architecture not in _PERMUTED:
        return None
    if ".attn_q." in stored:
        return config.num_heads
    return config.num_kv_heads if ".attn_k." in stored else None


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k permute: per head, rows [r0, r1, ...] were interleaved halves."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rope_scaling(gf: GGUFFile, arch: str, head_dim: int, theta: float) -> dict | None:
    md = gf.metadata
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if kind in ("linear", "yarn") and factor:
        scaling: dict = {"rope_type": kind, "factor": float(factor)}
        if kind == "yarn" and (orig := md.get(f"{arch}.rope.scaling.original_context_length")):
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    if kind not in (None, "none"):
        raise ModelLoadError(f"{gf.path}: rope scaling type {kind!r} is not supported")
    if "rope_freqs.weight" in gf.tensors:  # Llama 3.1+: per-frequency factors stored as a tensor
        return _llama3_scaling(gf.dequantize("rope_freqs.weight"), head_dim, theta, gf.path)
    return None


def _llama3_scaling(factors: np.ndarray, head_dim: int, theta: float, path: Path) -> dict | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    llama.cpp stores only the resulting factors; every Llama 3.x release uses low 1, high 4,
    original context 8192, so we assume those, recompute, and refuse anything else.
    """
    factor = float(factors.max())
    if factor == 1.0:
        return None
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    expected = []
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            expected.append(1.0)
        elif wavelen > low_wavelen:
            expected.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if factors.shape != (head_dim // 2,) or not np.allclose(factors, expected, rtol=1e-4):
        raise ModelLoadError(f"{path}: rope_freqs.weight is not Llama-3 rope scaling; unsupported")
    return scaling


def _eos_token_ids(md: dict) -> tuple[int, ...]:
    ids = [md.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    tokens, types = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        ids += [int(i) for i in np.flatnonzero(types == _CONTROL) if tokens[i] in _EOG_TEXTS]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def _int_or_none(value: object) -> int | None:
    return None if value is None else int(value)
