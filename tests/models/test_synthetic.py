"""Synthetic models: real shapes, deterministic random weights that transformers accepts."""

from __future__ import annotations

import pytest
import torch

from kamado.config import SUPPORTED_ARCHITECTURES
from kamado.models.errors import ModelLoadError
from kamado.models.layout import expected_weights, parameter_count
from kamado.models.loader import load_model_config, load_weights
from kamado.models.reference import transformers_model
from kamado.models.source import ModelSource
from kamado.models.synthetic import SHAPES, synthetic_config, synthetic_weights, tiny_config


@pytest.mark.parametrize(
    ("shape", "billions"),
    # Parameter counts published on the model cards.
    [("llama3-8b", 8.03), ("llama3-70b", 70.55), ("qwen3-8b", 8.19), ("qwen3-32b", 32.76),
     ("qwen2.5-7b", 7.62), ("mistral-7b", 7.25), ("qwen2.5-0.5b", 0.49), ("qwen3-0.6b", 0.60)],
)  # fmt: skip
def test_shapes_have_the_published_parameter_counts(shape, billions):
    assert parameter_count(SHAPES[shape]) / 1e9 == pytest.approx(billions, abs=0.005)


def test_weights_are_deterministic_and_seeded():
    config = tiny_config("qwen3")
    a = synthetic_weights(config, torch.float32)
    b = synthetic_weights(config, torch.float32)
    c = synthetic_weights(config, torch.float32, seed=1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])


def test_weights_have_expected_shapes_and_scale():
    config = tiny_config("qwen2", hidden_size=256, intermediate_size=512)
    weights = synthetic_weights(config, torch.bfloat16)
    assert {n: tuple(t.shape) for n, t in weights.items()} == expected_weights(config)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert torch.equal(weights["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    std = weights["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert std == pytest.approx(0.02, rel=0.05)


@pytest.mark.parametrize("arch", SUPPORTED_ARCHITECTURES)
def test_tiny_models_load_strictly_into_transformers_and_stay_finite(arch):
    source = ModelSource("synthetic", f"tiny-{arch}", None)
    config = load_model_config(source)
    assert config == tiny_config(arch)
    model = transformers_model(config, load_weights(source, config, torch.float32))
    with torch.no_grad():
        logits = model(torch.arange(1, 65).unsqueeze(0)).logits
    assert logits.shape == (1, 64, config.vocab_size)
    assert torch.isfinite(logits).all() and logits.std() > 0


def test_tiny_config_overrides():
    config = tiny_config("llama", num_layers=3, sliding_window=8)
    assert (config.num_layers, config.sliding_window, config.architecture) == (3, 8, "llama")


def test_unknown_shape():
    with pytest.raises(ModelLoadError, match="unknown synthetic shape"):
        synthetic_config("tiny-gpt2")
