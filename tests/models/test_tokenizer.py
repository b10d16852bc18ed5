"""Tokenizers: converted once from a GGUF and cached; identical to transformers' own."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from kamado.models.source import ModelSource
from kamado.models.tokenizer import load_tokenizer, tokenizer_cache_dir

SAMPLES = [
    "Hello, world!",
    "def add(a: int, b: int) -> int:\n    return a + b  # sum\n",
    "  indented\ttabs\r\nand CRLF",
    "naïve café — 東京 🚀 Привет",
    '{"tool": "read_file", "arguments": {"path": "src/main.py"}}',
    "<|im_start|>user\nhi<|im_end|>",
]
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Write fizzbuzz."},
    {"role": "assistant", "content": "for i in range(1, 16): ..."},
    {"role": "user", "content": "Shorter."},
]


def assert_same_tokenizer(ours, reference):
    for text in SAMPLES:
        assert ours.encode(text) == reference.encode(text), text
        assert ours.decode(ours.encode(text)) == reference.decode(reference.encode(text))
    assert ours.chat_template and ours.chat_template == reference.chat_template
    rendered = ours.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == reference.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ours.eos_token == reference.eos_token


@pytest.mark.slow
def test_gguf_tokenizer_is_converted_once_and_cached(smollm2_path, tmp_path, monkeypatch):
    monkeypatch.setenv("KAMADO_HOME", str(tmp_path))
    source = ModelSource("gguf", "smollm2", smollm2_path)
    first = load_tokenizer(source)
    cache = tokenizer_cache_dir(smollm2_path)
    assert cache.parent == tmp_path / "tokenizers"
    assert (cache / "tokenizer.json").is_file() and (cache / "chat_template.jinja").is_file()

    conversions = []
    real = AutoTokenizer.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        conversions.append(kwargs.get("gguf_file"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", classmethod(spy))
    second = load_tokenizer(source)
    assert conversions == [None]  # loaded from the cache, no GGUF conversion
    reference = real(AutoTokenizer, smollm2_path.parent, gguf_file=smollm2_path.name)
    assert_same_tokenizer(first, reference)
    assert_same_tokenizer(second, reference)


@pytest.mark.slow
def test_qwen_tokenizer_matches_transformers_and_renders_tools(qwen05_path):
    ours = load_tokenizer(ModelSource("gguf", "qwen", qwen05_path))
    reference = AutoTokenizer.from_pretrained(qwen05_path.parent, gguf_file=qwen05_path.name)
    assert_same_tokenizer(ours, reference)
    tool = {
        "type": "function",
        "function": {"name": "read_file", "parameters": {"type": "object", "properties": {}}},
    }
    rendered = ours.apply_chat_template(MESSAGES[:2], tools=[tool], tokenize=False)
    assert "<tools>" in rendered and "read_file" in rendered


def test_hf_directory_tokenizer(tmp_path):
    vocab = {"[UNK]": 0, "hello": 1, "world": 2}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", chat_template=template
    ).save_pretrained(tmp_path)
    tokenizer = load_tokenizer(ModelSource("hf", "tiny", tmp_path))
    assert tokenizer.encode("hello world nope") == [1, 2, 0]
    assert tokenizer.chat_template == template


def test_synthetic_models_have_no_tokenizer():
    assert load_tokenizer(ModelSource("synthetic", "qwen3-8b", None)) is None
