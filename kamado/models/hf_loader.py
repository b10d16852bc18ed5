"""ModelConfig and weights from a Hugging Face directory (config.json + *.safetensors)."""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open

from kamado.config import SUPPORTED_ARCHITECTURES, ModelConfig
from kamado.models.errors import ModelLoadError
from kamado.models.layout import check_shape, expected_weights, missing

# Defaults of the transformers config classes, for config.json files that omit the key.
_DEFAULT_MAX_POSITIONS = {"llama": 2048, "mistral": 131072, "qwen2": 32768, "qwen3": 32768}


def hf_model_config(directory: Path) -> ModelConfig:
    cfg = _read_json(directory / "config.json")
    arch = cfg.get("model_type")
    where = str(directory)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{where}: unsupported architecture {arch!r} (config.json model_type); "
            f"kamado supports: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _refuse(where, cfg.get("hidden_act", "silu") != "silu", f"hidden_act {cfg.get('hidden_act')!r}")
    _refuse(where, bool(cfg.get("mlp_bias")), "mlp_bias")
    # qwen2 always has q/k/v biases; elsewhere attention_bias also puts a bias on o_proj.
    _refuse(where, arch != "qwen2" and bool(cfg.get("attention_bias")), "attention_bias")
    heads = int(cfg["num_attention_heads"])
    rope_theta, rope_scaling = _rope(cfg)
    generation = _read_json(directory / "generation_config.json", missing_ok=True)
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(
                cfg.get("max_position_embeddings") or _DEFAULT_MAX_POSITIONS[arch]
            ),
            qkv_bias=arch == "qwen2",
            qk_norm=arch == "qwen3",
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            sliding_window=_sliding_window(cfg, arch, where),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(
                dict.fromkeys(_ids(cfg.get("eos_token_id")) + _ids(generation.get("eos_token_id")))
            ),
        )
    except KeyError as e:
        raise ModelLoadError(f"{where}: config.json has no {e.args[0]!r}") from e
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from e


def hf_weights(
    directory: Path, config: ModelConfig, dtype: torch.dtype, device: str
) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(directory, config, dtype, device))


def iter_hf_weights(
    directory: Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: str,
    skip: Collection[str] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every expected tensor but those in `skip`, read one at a time; every name and shape
    is checked before the first is read."""
    where = str(directory)
    files = _weight_files(directory)
    expected = {n: s for n, s in expected_weights(config).items() if n not in skip}
    with ExitStack() as stack:
        handles = {}
        for name, shape in expected.items():
            if name not in files:
                raise missing(name, where)
            file = files[name]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(file, framework="pt"))
            check_shape(name, tuple(handles[file].get_slice(name).get_shape()), shape, where)
        for name in expected:
            yield name, handles[files[name]].get_tensor(name).to(device=device, dtype=dtype)


def _weight_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (sharded index, else every file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map", {})
        return {name: directory / file for name, file in weight_map.items()}
    files: dict[str, Path] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            files.update(dict.fromkeys(f.keys(), file))
    return files


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(theta, HF-style scaling dict or None) from transformers 5 rope_parameters or the older
    rope_theta + rope_scaling pair."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(cfg: dict, arch: str, where: str) -> int | None:
    window = cfg.get("sliding_window")
    if arch == "mistral" or not window:
        return int(window) if window else None
    if arch == "llama":
        return None
    # qwen2/qwen3 keep a sliding_window value even when unused; layer_types says where it applies.
    n = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types") or [
        "sliding_attention"
        if cfg.get("use_sliding_window") and i >= cfg.get("max_window_layers", n)
        else "full_attention"
        for i in range(n)
    ]
    if all(t == "full_attention" for t in layer_types):
        return None
    _refuse(where, any(t != "sliding_attention" for t in layer_types), "mixed sliding/full layers")
    return int(window)


def _ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _refuse(where: str, condition: bool, feature: str) -> None:
    if condition:
        raise ModelLoadError(f"{where}: {feature} is not supported by kamado's model code")


def _read_json(path: Path, missing_ok: bool = False) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ModelLoadError(f"{path} is missing") from None
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e
