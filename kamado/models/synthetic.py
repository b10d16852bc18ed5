"""Random-weight models at real shapes (GPU benchmarks) and tiny ones (tests).

Decode speed depends on shapes, not weight values, so benchmarks of 8B-70B shapes need no
download. Weights are generated on the target device, tensor by tensor, from a seed derived
from the tensor name, so a run is reproducible and never builds a float32 copy on the host.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING

from kamado.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kamado.models.errors import ModelLoadError
from kamado.models.layout import expected_weights

if TYPE_CHECKING:
    import torch

_LLAMA31_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _qwen3(hidden: int, inter: int, layers: int, heads: int, tie: bool) -> ModelConfig:
    return ModelConfig(
        "qwen3", 151936, hidden, inter, layers, heads, 8, 128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, qk_norm=True, tie_word_embeddings=tie,
    )  # fmt: skip


def _llama31(hidden: int, inter: int, layers: int, heads: int) -> ModelConfig:
    return ModelConfig(
        "llama", 128256, hidden, inter, layers, heads, 8, 128, rms_norm_eps=1e-5,
        rope_theta=500000.0, rope_scaling=dict(_LLAMA31_ROPE), max_position_embeddings=131072,
    )  # fmt: skip


# Published config.json values of the upstream models (llama3-* are the Llama 3.1 releases,
# mistral-7b is v0.3).
SHAPES: dict[str, ModelConfig] = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, tie=True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, tie=False),
    # Qwen3-8B as served with its 128k context (upstream stretches rope with YaRN there;
    # this keeps plain rope: the shapes, and so the speed, are the same).
    "qwen3-8b-128k": dataclasses.replace(
        _qwen3(4096, 12288, 36, 32, tie=False), max_position_embeddings=131072
    ),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, tie=False),
    "llama3-8b": _llama31(4096, 14336, 32, 32),
    "llama3-70b": _llama31(8192, 28672, 80, 64),
    "qwen2.5-0.5b": ModelConfig(
        "qwen2", 151936, 896, 4864, 24, 14, 2, 64, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, qkv_bias=True, tie_word_embeddings=True,
    ),
    "qwen2.5-7b": ModelConfig(
        "qwen2", 152064, 3584, 18944, 28, 28, 4, 128, rms_norm_eps=1e-6, rope_theta=1e6,
        max_position_embeddings=32768, qkv_bias=True,
    ),
    "mistral-7b": ModelConfig(
        "mistral", 32768, 4096, 14336, 32, 32, 8, 128, rms_norm_eps=1e-5, rope_theta=1e6,
        max_position_embeddings=32768,
    ),
}  # fmt: skip


def tiny_config(architecture: str, **overrides: object) -> ModelConfig:
    """A 2-layer model of the given architecture, small enough for a unit test on CPU."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"no tiny config for {architecture!r}; have {SUPPORTED_ARCHITECTURES}")
    config = ModelConfig(
        architecture=architecture,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        # qwen3 decouples head_dim from hidden/heads; keep that difference visible in tests.
        head_dim=32 if architecture == "qwen3" else 16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        qkv_bias=architecture == "qwen2",
        qk_norm=architecture == "qwen3",
        tie_word_embeddings=architecture == "qwen2",
    )
    return dataclasses.replace(config, **overrides)


def shape_names() -> list[str]:
    return [*SHAPES, *(f"tiny-{arch}" for arch in SUPPORTED_ARCHITECTURES)]


def synthetic_config(shape: str) -> ModelConfig:
    """The config of `synthetic:<shape>`: a real model's shape or tiny-<architecture>."""
    if shape in SHAPES:
        return SHAPES[shape]
    if shape.startswith("tiny-") and shape[5:] in SUPPORTED_ARCHITECTURES:
        return tiny_config(shape[5:])
    raise ModelLoadError(f"unknown synthetic shape {shape!r}; have: {', '.join(shape_names())}")


def synthetic_weights(
    config: ModelConfig, dtype: torch.dtype, device: str = "cpu", seed: int = 0
) -> dict[str, torch.Tensor]:
    """Deterministic random weights: N(0, 0.02) matrices and biases, norms at 1, so
    activations stay in a realistic, finite range at any depth."""
    return dict(iter_synthetic_weights(config, dtype, device, seed))


def iter_synthetic_weights(
    config: ModelConfig,
    dtype: torch.dtype,
    device: str = "cpu",
    seed: int = 0,
    skip: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """synthetic_weights one tensor at a time, each made only when asked for."""
    import torch  # here, so listing shapes (`kamado models`) does not load torch

    for name, shape in expected_weights(config).items():
        if name in skip:
            continue
        if name.endswith("norm.weight"):
            yield name, torch.ones(shape, dtype=dtype, device=device)
            continue
        gen = torch.Generator(device=device)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        tensor = torch.randn(shape, generator=gen, dtype=dtype, device=device)
        yield name, tensor.mul_(0.02)
