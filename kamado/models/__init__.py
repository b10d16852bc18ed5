"""Models: the named-model registry, download and verification, GGUF / HF / synthetic
loaders producing a ModelConfig plus weights under Hugging Face names, and tokenizers."""

from __future__ import annotations

from typing import TYPE_CHECKING

# These import neither torch nor transformers, so `kamado pull` / `kamado models` start fast.
# (Eager on purpose: `pull` must name the function, not the kamado.models.pull module.)
from kamado.models.errors import ModelLoadError
from kamado.models.pull import cached_model_path, pull
from kamado.models.source import ModelSource, resolve_model
from kamado.models.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from kamado.models.loader import load_model_config, load_weights

__all__ = [
    "ModelLoadError",
    "ModelSource",
    "cached_model_path",
    "load_model_config",
    "load_tokenizer",
    "load_weights",
    "pull",
    "resolve_model",
]


def __getattr__(name: str) -> object:
    # The loaders need torch; resolve them on first use.
    if name in ("load_model_config", "load_weights"):
        from kamado.models import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'kamado.models' has no attribute {name!r}")
