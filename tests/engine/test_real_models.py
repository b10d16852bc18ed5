"""Real pretrained models (GGUF through PyPI): greedy tokens identical to transformers."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kamado import LLM, SamplingParams
from tests.engine.conftest import hf_greedy

pytestmark = pytest.mark.slow

PROMPTS = [
    "def fibonacci(n):",
    "# A Python function that parses a CSV file and returns a list of dicts\n",
    "The capital of France is",
    "import json\n\ndata = {'a': 1, 'b': [1, 2, 3]}\n",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module", params=["smollm2", "qwen05"])
def real_model(request):
    path = request.getfixturevalue(f"{request.param}_path")
    return path, LLM(str(path), dtype="float32", kv_cache_bytes=256 << 20)


@pytest.fixture(scope="module")
def hf_model(real_model):
    path, _ = real_model
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def test_greedy_tokens_match_transformers_alone_and_batched(real_model, hf_model):
    _, llm = real_model
    # Both stop at the model's end-of-sequence token; transformers' min_new_tokens would
    # instead ban it, which changes the distribution rather than ignoring the stop.
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
    batched = llm.generate(PROMPTS, params)
    eos = sorted(llm.engine.eos_token_ids)
    lengths = []
    for prompt, result in zip(PROMPTS, batched, strict=True):
        ids = result.prompt_token_ids
        ref = hf_greedy(hf_model, ids, NEW_TOKENS, eos)
        assert result.outputs[0].token_ids == ref, prompt
        lengths.append(len(ref))
    assert max(lengths) == NEW_TOKENS  # long outputs were compared, not only early stops
    alone = llm.generate(PROMPTS[0], params)[0]
    assert alone.outputs[0].token_ids == batched[0].outputs[0].token_ids
    assert alone.outputs[0].text == llm.tokenizer.decode(
        alone.outputs[0].token_ids, skip_special_tokens=True
    )


def test_logit_bias_follows_transformers_sequence_bias(real_model, hf_model):
    _, llm = real_model
    prompt = PROMPTS[0]
    free = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24))[0]
    ids, out = free.prompt_token_ids, free.outputs[0].token_ids
    # Ban the free run's first two tokens (it must take another path from its first token)
    # and push another it wrote, so both signs of bias are exercised.
    pushed = next(t for t in out[2:] if t not in (out[0], out[1]))
    bias = {out[0]: -100.0, out[1]: -100.0, pushed: 4.0}
    biased = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=24, logit_bias=bias))[
        0
    ].outputs[0]
    eos = sorted(llm.engine.eos_token_ids)
    assert biased.token_ids == hf_greedy(hf_model, ids, 24, eos, logit_bias=bias)
    assert biased.token_ids[0] != out[0]
    assert not {out[0], out[1]} & set(biased.token_ids)


def test_stop_strings_cut_text_at_the_first_match(real_model):
    _, llm = real_model
    free = llm.generate("def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=40))
    text = free[0].outputs[0].text
    assert len(text) > 10
    stop = text[5:8]  # a stop string taken from inside the real output
    out = llm.generate(
        "def fibonacci(n):", SamplingParams(temperature=0.0, max_tokens=40, stop=[stop])
    )[0].outputs[0]
    assert out.text == text[: text.index(stop)]
    assert out.finish_reason == "stop"
    assert llm.engine.pool.num_used == 0
