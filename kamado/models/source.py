"""Turn what the user typed (--model) into a concrete, local model source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kamado.models import registry
from kamado.models.errors import ModelLoadError
from kamado.models.pull import cached_model_path, pull
from kamado.models.synthetic import shape_names, synthetic_config

SourceKind = Literal["gguf", "hf", "synthetic"]


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    name: str  # registry name, file/dir name, or synthetic shape
    path: Path | None  # the .gguf file or HF directory; None for synthetic


def resolve_model(spec: str, allow_pull: bool = True) -> ModelSource:
    """A registry name or alias, a .gguf file, an HF directory, or synthetic:<shape>."""
    if spec.startswith("synthetic:"):
        shape = spec.removeprefix("synthetic:")
        synthetic_config(shape)  # raises for an unknown shape
        return ModelSource("synthetic", shape, None)
    if (named := registry.lookup(spec)) is not None:
        path = cached_model_path(named.name)
        if path is None:
            if not allow_pull:
                raise ModelLoadError(
                    f"model {named.name} is not downloaded yet; run `kamado pull {named.name}`"
                )
            path = pull(named.name)
        return ModelSource("gguf", named.name, path)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.stem, path.resolve())
    if path.is_dir() and _is_hf_dir(path):
        return ModelSource("hf", path.resolve().name, path.resolve())
    raise ModelLoadError(_explain(spec, path))


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _explain(spec: str, path: Path) -> str:
    if path.is_dir():
        problem = (
            f"{path} is a directory without config.json and *.safetensors files "
            "(only safetensors weights are read)"
        )
    elif path.exists():
        problem = f"{path} is not a .gguf file"
    else:
        problem = f"unknown model {spec!r}"
    return (
        f"{problem}.\nA model is one of:\n"
        f"  a named model: {', '.join(registry.names())}\n"
        "  a path to a .gguf file\n"
        "  a Hugging Face directory (config.json, *.safetensors, tokenizer files)\n"
        f"  synthetic:<shape> (random weights), shapes: {', '.join(shape_names())}"
    )
