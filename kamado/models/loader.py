"""Config and weights for any model source, whatever its format."""

from __future__ import annotations

from types import ModuleType

import torch

from kamado.config import ModelConfig
from kamado.models.errors import ModelLoadError
from kamado.models.hf_loader import hf_model_config, hf_weights
from kamado.models.source import ModelSource
from kamado.models.synthetic import synthetic_config, synthetic_weights


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
    if source.kind == "synthetic":
        return synthetic_weights(config, dtype, device)
    assert source.path is not None
    if source.kind == "gguf":
        return _gguf().gguf_weights(source.path, config, dtype, device)
    return hf_weights(source.path, config, dtype, device)


def _gguf() -> ModuleType:
    # The GPU machine has no gguf package; synthetic and HF models must load without it.
    try:
        from kamado.models import gguf_loader
    except ImportError as e:
        raise ModelLoadError(f"reading GGUF files needs the gguf package ({e})") from e
    return gguf_loader
