"""GGUF -> ModelConfig + HF-named weights: small files written like llama.cpp does, and the
two real models checked against transformers' own GGUF loader."""

from __future__ import annotations

import dataclasses
import functools
import math

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kamado.models.errors import ModelLoadError
from kamado.models.gguf_loader import gguf_model_config, gguf_weights
from kamado.models.loader import load_model_config, load_weights
from kamado.models.source import ModelSource
from kamado.models.synthetic import synthetic_weights, tiny_config
from tests.models.gguf_files import write_gguf

# llama.cpp writes mistral models as "llama"; these are the GGUF architectures we read.
GGUF_ARCHS = ["llama", "qwen2", "qwen3"]


def written(tmp_path, model_arch: str, **options):
    config = tiny_config(model_arch, bos_token_id=1)
    weights = synthetic_weights(config, torch.float32, seed=7)
    path = tmp_path / f"{model_arch}.gguf"
    write_gguf(path, config, weights, **options)
    return path, config, weights


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_config_read_back(tmp_path, arch):
    path, config, _ = written(tmp_path, arch)
    got = gguf_model_config(path)
    assert got == dataclasses.replace(config, rms_norm_eps=got.rms_norm_eps)
    assert got.rms_norm_eps == pytest.approx(config.rms_norm_eps)  # stored as float32


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_weights_read_back_exactly_with_llama_permutation_undone(tmp_path, arch):
    path, config, weights = written(tmp_path, arch)
    got = gguf_weights(path, config, torch.float32, "cpu")
    assert list(got) == list(weights)
    for name, tensor in weights.items():
        assert torch.equal(got[name], tensor), name


def test_load_dispatch_and_dtype(tmp_path):
    path, config, weights = written(tmp_path, "qwen3")
    source = ModelSource("gguf", "t", path)
    got = load_weights(source, load_model_config(source), torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["model.norm.weight"], weights["model.norm.weight"].bfloat16())


def test_quantized_tensors_are_dequantized(tmp_path):
    path, config, weights = written(tmp_path, "llama", quantized=GGMLQuantizationType.Q8_0)
    got = gguf_weights(path, config, torch.float32, "cpu")
    name = "model.layers.1.mlp.down_proj.weight"
    original = weights[name].numpy()
    roundtrip = dequantize(quantize(original, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    assert np.array_equal(got[name].numpy(), roundtrip)
    assert not np.array_equal(roundtrip, original)  # really went through Q8_0
    q = got["model.layers.0.self_attn.q_proj.weight"]
    assert torch.allclose(q, weights["model.layers.0.self_attn.q_proj.weight"], atol=2e-3)


def test_missing_tensor_is_named(tmp_path):
    path, config, _ = written(tmp_path, "qwen2", skip=("blk.1.attn_v.bias",))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.v_proj\.bias .*blk\.1"):
        gguf_weights(path, config, torch.float32, "cpu")


def test_mis_shaped_tensor_is_named(tmp_path):
    path, config, _ = written(tmp_path, "qwen2")
    wrong = dataclasses.replace(config, intermediate_size=96)
    with pytest.raises(ModelLoadError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape"):
        gguf_weights(path, wrong, torch.float32, "cpu")


def test_unsupported_architecture_names_the_supported_ones(tmp_path):
    path, _, _ = written(tmp_path, "llama", arch="gpt2")
    with pytest.raises(ModelLoadError, match="'gpt2'.*llama, mistral, qwen2, qwen3"):
        gguf_model_config(path)


def test_end_of_generation_ids_come_from_eos_and_control_tokens(tmp_path):
    tokens = [f"t{i}" for i in range(256)]
    tokens[5], tokens[6], tokens[7] = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
    types = [1] * 256
    types[5] = types[6] = types[7] = 3
    path, _, _ = written(tmp_path, "qwen2", tokens=tokens, token_types=types, eos=5)
    assert gguf_model_config(path).eos_token_ids == (5, 6)


def llama3_factors(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """rope_freqs as convert_hf_to_gguf.py computes it for Llama 3.1."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    config = tiny_config("llama", head_dim=128, num_heads=4, hidden_size=512, rope_theta=500000.0)
    path = tmp_path / "l3.gguf"
    factors = {"rope_freqs.weight": llama3_factors(128, 500000.0, 8.0)}
    write_gguf(path, config, synthetic_weights(config, torch.float32), extra_tensors=factors)
    assert gguf_model_config(path).rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_unknown_rope_freqs_are_refused(tmp_path):
    config = tiny_config("llama")
    path = tmp_path / "odd.gguf"
    odd = {"rope_freqs.weight": np.linspace(1, 3, config.head_dim // 2, dtype=np.float32)}
    write_gguf(path, config, synthetic_weights(config, torch.float32), extra_tensors=odd)
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        gguf_model_config(path)


# --- the real models, against transformers' GGUF integration ---------------------------------


def transformers_gguf(path):
    """transformers' own GGUF load (config and float32 state dict): the reference."""
    import transformers.modeling_utils as modeling_utils
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        # transformers asks for accelerate only for device maps; its GGUF path runs without it.
        mp.setattr(modeling_utils, "is_accelerate_available", lambda: True)
        # It parses the file twice (config, then tensors); one read-only parse is enough.
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return model.config, model.state_dict()


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_path):
    return transformers_gguf(smollm2_path)


@pytest.fixture(scope="module")
def qwen05_reference(qwen05_path):
    return transformers_gguf(qwen05_path)


def assert_config_matches(path, hf):
    ours = gguf_model_config(path)
    assert ours.architecture == hf.model_type
    assert ours.vocab_size == hf.vocab_size
    assert ours.hidden_size == hf.hidden_size
    assert ours.intermediate_size == hf.intermediate_size
    assert ours.num_layers == hf.num_hidden_layers
    assert ours.num_heads == hf.num_attention_heads
    assert ours.num_kv_heads == hf.num_key_value_heads
    heads = hf.num_attention_heads
    assert ours.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // heads)
    assert ours.rms_norm_eps == hf.rms_norm_eps
    assert ours.rope_theta == hf.rope_parameters["rope_theta"]
    assert hf.rope_parameters["rope_type"] == "default" and ours.rope_scaling is None
    assert ours.max_position_embeddings == hf.max_position_embeddings
    assert ours.tie_word_embeddings == hf.tie_word_embeddings
    assert ours.bos_token_id == hf.bos_token_id
    assert ours.eos_token_ids[0] == hf.eos_token_id
    return ours


def assert_weights_match(path, reference):
    config = gguf_model_config(path)
    ours = gguf_weights(path, config, torch.float32, "cpu")
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(reference) - set(ours) == tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


@pytest.mark.slow
def test_smollm2_config_matches_transformers(smollm2_path, smollm2_reference):
    config = assert_config_matches(smollm2_path, smollm2_reference[0])
    assert (config.architecture, config.num_layers) == ("llama", 30)
    assert config.tie_word_embeddings
    assert config.eos_token_ids == (2, 0)  # <|im_end|>, then <|endoftext|>


@pytest.mark.slow
def test_qwen05_config_matches_transformers(qwen05_path, qwen05_reference):
    config = assert_config_matches(qwen05_path, qwen05_reference[0])
    assert (config.architecture, config.qkv_bias, config.qk_norm) == ("qwen2", True, False)
    assert config.eos_token_ids == (151645, 151643)  # as Qwen's generation_config.json


@pytest.mark.slow
def test_smollm2_weights_equal_transformers(smollm2_path, smollm2_reference):
    assert_weights_match(smollm2_path, smollm2_reference[1])


@pytest.mark.slow
def test_qwen05_weights_equal_transformers(qwen05_path, qwen05_reference):
    assert_weights_match(qwen05_path, qwen05_reference[1])
