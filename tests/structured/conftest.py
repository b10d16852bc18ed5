"""One real model (qwen2.5-coder-0.5b) shared by the module's structured-output tests."""

from __future__ import annotations

import pytest

from kamado import LLM


@pytest.fixture(scope="module")
def qwen_llm(qwen05_path) -> LLM:
    return LLM(str(qwen05_path), kv_cache_bytes=256 << 20)


def chat_prompt(llm: LLM, question: str) -> str:
    messages = [
        {"role": "system", "content": "Answer with JSON only."},
        {"role": "user", "content": question},
    ]
    return llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
