"""resolve_model: every accepted form, and errors that say what is accepted."""

from __future__ import annotations

import pytest
import torch

from kamado.models import ModelLoadError, ModelSource, resolve_model
from kamado.models.synthetic import synthetic_weights, tiny_config
from tests.models.gguf_files import write_gguf


def test_synthetic_spec():
    assert resolve_model("synthetic:qwen3-8b") == ModelSource("synthetic", "qwen3-8b", None)
    assert resolve_model("synthetic:tiny-llama").name == "tiny-llama"


def test_unknown_synthetic_shape_lists_shapes():
    with pytest.raises(ModelLoadError, match="qwen3-8b.*tiny-qwen3"):
        resolve_model("synthetic:gpt-5")


def test_gguf_file_path(tmp_path):
    config = tiny_config("qwen3")
    path = tmp_path / "My-Model.Q8_0.gguf"
    write_gguf(path, config, synthetic_weights(config, torch.float32))
    assert resolve_model(str(path)) == ModelSource("gguf", "My-Model.Q8_0", path)


def test_named_model_not_pulled_says_how_to_pull(tmp_path, monkeypatch):
    monkeypatch.setenv("KAMADO_HOME", str(tmp_path))
    with pytest.raises(ModelLoadError, match="kamado pull smollm2-135m-instruct"):
        resolve_model("smollm2-135m", allow_pull=False)


def test_named_model_is_pulled_on_first_use(fake_model, downloads):
    source = resolve_model("FAKE")  # aliases are case-insensitive
    assert (source.kind, source.name) == ("gguf", "fake-model")
    assert source.path.is_file() and len(downloads) == 1


def test_unknown_spec_lists_named_models_and_forms():
    with pytest.raises(ModelLoadError) as info:
        resolve_model("llama-9000")
    message = str(info.value)
    for expected in (
        "unknown model 'llama-9000'",
        "qwen2.5-coder-0.5b-instruct",
        "smollm2-135m",
        ".gguf file",
        "Hugging Face directory",
        "synthetic:<shape>",
    ):
        assert expected in message


def test_directory_without_a_model(tmp_path):
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_model(str(tmp_path))


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        resolve_model(str(path))
