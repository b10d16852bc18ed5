"""Our GGUF reader agrees with gguf.GGUFReader on metadata and tensor bytes, and rejects
damaged files."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader

from kamado.models.errors import ModelLoadError
from kamado.models.gguf_reader import GGUFFile
from kamado.models.synthetic import synthetic_weights, tiny_config
from tests.models.gguf_files import write_gguf

TOKENS = [f"tok{i}" for i in range(256)]


@pytest.fixture
def small_gguf(tmp_path):
    path = tmp_path / "m.gguf"
    config = tiny_config("qwen2")
    write_gguf(
        path, config, synthetic_weights(config, torch.float32), quantized=GGMLQuantizationType.Q8_0,
        tokens=TOKENS, eos=3,
    )  # fmt: skip
    return path


def assert_matches_reference(ours: GGUFFile, ref: GGUFReader, skipped: set[str]) -> None:
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key in skipped:
            continue
        value = ours.metadata[key]
        assert (value.tolist() if isinstance(value, np.ndarray) else value) == field.contents(), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())), t.name
        assert info.ggml_type == t.tensor_type
        assert np.array_equal(ours.raw(t.name).reshape(-1), t.data.reshape(-1).view(np.uint8))


def test_reader_matches_gguf_reference(small_gguf):
    ours = GGUFFile(small_gguf, string_arrays={"tokenizer.ggml.tokens"})
    assert ours.metadata["tokenizer.ggml.tokens"] == TOKENS
    assert_matches_reference(ours, GGUFReader(small_gguf), skipped=set())


def test_large_string_arrays_are_skipped_unless_asked_for(small_gguf):
    assert "tokenizer.ggml.tokens" not in GGUFFile(small_gguf).metadata


def test_dequantize_returns_float32_in_torch_order(small_gguf):
    ours, ref = GGUFFile(small_gguf), GGUFReader(small_gguf)
    from gguf.quants import dequantize

    for t in ref.tensors:
        got = ours.dequantize(t.name)
        assert got.dtype == np.float32 and got.flags.writeable
        expected = dequantize(t.data, t.tensor_type).reshape(ours.tensors[t.name].shape)
        assert np.array_equal(got, expected), t.name


def test_truncated_file_is_rejected(small_gguf):
    data = small_gguf.read_bytes()
    small_gguf.write_bytes(data[:-100])
    with pytest.raises(ModelLoadError, match="truncated"):
        GGUFFile(small_gguf)


def test_header_cut_short_is_rejected(small_gguf):
    small_gguf.write_bytes(small_gguf.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="not a valid GGUF"):
        GGUFFile(small_gguf)


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.slow
def test_reader_matches_gguf_reference_on_real_model(smollm2_path):
    ours = GGUFFile(smollm2_path, string_arrays={"tokenizer.ggml.tokens"})
    assert_matches_reference(ours, GGUFReader(smollm2_path), skipped={"tokenizer.ggml.merges"})
