"""`kamado pull NAME` and `kamado models`; the CLI parses arguments and calls these."""

from __future__ import annotations

import argparse
import sys

from kamado.config import DEFAULT_MODEL, kamado_home
from kamado.models.errors import ModelLoadError
from kamado.models.layout import parameter_count
from kamado.models.pull import cached_model_path, pull
from kamado.models.registry import NAMED_MODELS, named_model
from kamado.models.synthetic import SHAPES


def cmd_pull(args: argparse.Namespace | str) -> int:
    """Download and verify a named model (args.name, or a plain name); returns the exit code."""
    name = args if isinstance(args, str) else args.name
    try:
        model = named_model(name)
        path = pull(model.name, progress=True)
    except ModelLoadError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"{model.name} is ready: {path}")
    return 0


def cmd_models(args: argparse.Namespace | None = None) -> int:
    """List named models (size, pulled or not, where) and the synthetic shapes."""
    print(f"Named models (kamado pull NAME; stored under {kamado_home() / 'models'}):")
    for model in NAMED_MODELS.values():
        default = "  [default]" if model.name == DEFAULT_MODEL else ""
        print(f"  {model.name}{default}")
        print(f"      {model.description}; {model.license}; {model.size / 1e6:,.0f} MB")
        print(f"      aliases: {', '.join(model.aliases)}; {_status(model.name)}")
    print("\nSynthetic models (random weights at real shapes, for benchmarks: synthetic:SHAPE):")
    for shape, config in SHAPES.items():
        params = parameter_count(config) / 1e9
        print(
            f"  {shape:<14} {config.architecture:<8} {params:6.2f}B params, "
            f"{config.num_layers} layers, hidden {config.hidden_size}"
        )
    print("  tiny-llama, tiny-mistral, tiny-qwen2, tiny-qwen3 (2-layer test models)")
    print("\nAlso accepted as a model: a path to a .gguf file or a Hugging Face directory.")
    return 0


def _status(name: str) -> str:
    try:
        path = cached_model_path(name)
    except ModelLoadError as e:
        return f"DAMAGED ({e})"
    return f"pulled: {path}" if path else "not pulled"
