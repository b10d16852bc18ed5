"""Config and weights for any model source, whatever its format."""

from __future__ import annotations

from collections.abc import Collection, Iterator
from types import ModuleType

import torch

from kamado.config import ModelConfig
from kamado.models.errors import ModelLoadError
from kamado.models.hf_loader import hf_model_config, iter_hf_weights
from kamado.models.source import ModelSource
from kamado.models.synthetic import iter_synthetic_weights, synthetic_config


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "synthetic":
        return synthetic_config(source.name)
    assert source.path is not None
    if source.kind == "gguf":
        return _gguf().gguf_model_config(source.path)
    return hf_model_config(source.path)


def load_weights(
    source: ModelSource, config: ModelConfig, dtype: torch.dtype, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """Every tensor of expected_weights(config), under HF names, or a ModelLoadError naming
    the first missing or mis-shaped one (never a partial dict)."""
    return dict(iter_weights(source, config, dtype, device))


def iter_weights(
    source: ModelSource,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str = "cpu",
    skip: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in expected_weights order, produced one at a time so a caller can
    transform each layer before the next is read; names in `skip` are not read."""
    if source.kind == "synthetic":
        return iter_synthetic_weights(config, dtype, device, skip=skip)
    assert source.path is not None
    if source.kind == "gguf":
        return _gguf().iter_gguf_weights(source.path, config, dtype, device, skip)
    return iter_hf_weights(source.path, config, dtype, device, skip)


def _gguf() -> ModuleType:
    # The GPU machine has no gguf package; synthetic and HF models must load without it.
    try:
        from kamado.models import gguf_loader
    except ImportError as e:
        raise ModelLoadError(f"reading GGUF files needs the gguf package ({e})") from e
    return gguf_loader
