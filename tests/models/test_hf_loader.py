"""Hugging Face directories: tiny transformers models saved with save_pretrained read back
to the same config and the same tensors."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kamado.models.errors import ModelLoadError
from kamado.models.hf_loader import hf_model_config, hf_weights
from kamado.models.layout import expected_weights
from kamado.models.loader import load_model_config, load_weights
from kamado.models.source import resolve_model
from tests.tiny_models import ARCHITECTURES, save_tiny_hf_model

ARCHS = ARCHITECTURES


def save_tiny(path, arch: str, shard: str = "1GB", **overrides):
    return save_tiny_hf_model(path, arch, shard=shard, **overrides)


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trip(tmp_path, arch):
    model = save_tiny(tmp_path, arch)
    config = hf_model_config(tmp_path)
    hf = model.config
    assert config.architecture == arch
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == (128, 64, 96)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.head_dim == (32 if arch == "qwen3" else 16)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rope_scaling is None
    assert config.max_position_embeddings == 256
    assert config.qkv_bias == (arch == "qwen2")
    assert config.qk_norm == (arch == "qwen3")
    assert config.tie_word_embeddings == (arch == "qwen2")
    # transformers' MistralConfig defaults to a 4096-token window; the others use none.
    assert config.sliding_window == (4096 if arch == "mistral" else None)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


@pytest.mark.parametrize("arch", ARCHS)
def test_weights_round_trip(tmp_path, arch):
    model = save_tiny(tmp_path, arch)
    source = resolve_model(str(tmp_path))
    assert source.kind == "hf"
    config = load_model_config(source)
    weights = load_weights(source, config, torch.float32)
    reference = model.state_dict()
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(reference) - set(weights) == tied
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[name]), name


def test_sharded_checkpoint_and_dtype(tmp_path):
    model = save_tiny(tmp_path, "qwen3", shard="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config = hf_model_config(tmp_path)
    weights = hf_weights(tmp_path, config, torch.bfloat16, "cpu")
    assert list(weights) == list(expected_weights(config))
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, model.state_dict()[name].bfloat16()), name


def test_missing_tensor_is_named(tmp_path):
    save_tiny(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight is missing"):
        hf_weights(tmp_path, hf_model_config(tmp_path), torch.float32, "cpu")


def test_mis_shaped_tensor_is_named(tmp_path):
    save_tiny(tmp_path, "llama")
    edit_config(tmp_path, intermediate_size=80)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        hf_weights(tmp_path, hf_model_config(tmp_path), torch.float32, "cpu")


def test_unsupported_model_type_names_the_supported_ones(tmp_path):
    save_tiny(tmp_path, "llama")
    edit_config(tmp_path, model_type="gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        load_model_config(resolve_model(str(tmp_path)))


def test_llama3_rope_parameters(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    save_tiny(tmp_path, "llama", rope_parameters=rope)
    config = hf_model_config(tmp_path)
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {k: v for k, v in rope.items() if k != "rope_theta"}


def test_older_rope_theta_and_rope_scaling_keys(tmp_path):
    save_tiny(tmp_path, "qwen2")
    edit_config(
        tmp_path, rope_parameters=None, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2}
    )
    config = hf_model_config(tmp_path)
    assert (config.rope_theta, config.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 2})


def test_unused_qwen_sliding_window_is_ignored(tmp_path):
    # Real Qwen2.5 config.json files carry sliding_window with use_sliding_window false.
    save_tiny(tmp_path, "qwen2")
    edit_config(tmp_path, layer_types=None, use_sliding_window=False, sliding_window=32768)
    assert hf_model_config(tmp_path).sliding_window is None


def test_sliding_window_on_some_layers_only_is_refused(tmp_path):
    save_tiny(tmp_path, "qwen2")
    edit_config(tmp_path, layer_types=["full_attention", "sliding_attention"], sliding_window=64)
    with pytest.raises(ModelLoadError, match="mixed sliding/full"):
        hf_model_config(tmp_path)


def test_attention_bias_on_output_projection_is_refused(tmp_path):
    save_tiny(tmp_path, "llama", attention_bias=True)
    with pytest.raises(ModelLoadError, match="attention_bias"):
        hf_model_config(tmp_path)


def test_generation_config_adds_end_tokens(tmp_path):
    save_tiny(tmp_path, "qwen3")
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert hf_model_config(tmp_path).eos_token_ids == (2, 7)
