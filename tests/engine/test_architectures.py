"""Greedy tokens of our model code match transformers (fp32) for every architecture."""

import pytest

from tests.engine.conftest import ARCHITECTURES, greedy, hf_greedy, make_engine, run

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(40, 77)), [300]]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers(tiny_models, arch):
    path, reference = tiny_models[arch]
    engine = make_engine(path)
    out = run(engine, {str(i): (p, greedy(24)) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)][0] == hf_greedy(reference, prompt, 24), f"{arch} prompt {i}"


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_chunked_prefill_matches_transformers(tiny_models, arch):
    path, reference = tiny_models[arch]
    engine = make_engine(path, max_num_batched_tokens=5, block_size=4)
    out = run(engine, {str(i): (p, greedy(16)) for i, p in enumerate(PROMPTS)})
    for i, prompt in enumerate(PROMPTS):
        assert out[str(i)][0] == hf_greedy(reference, prompt, 16)


def test_sliding_window_matches_transformers(tmp_path):
    from tests.engine.conftest import tiny_hf_model

    reference = tiny_hf_model("mistral", tmp_path, sliding_window=8)
    engine = make_engine(tmp_path, block_size=4)
    prompt = list(range(10, 30))
    assert run(engine, {"a": (prompt, greedy(12))})["a"][0] == hf_greedy(reference, prompt, 12)
