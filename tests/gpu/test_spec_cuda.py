"""Speculation on CUDA (Triton attention, CUDA graphs for plain decode steps, eager
verification): greedy output follows the non-speculative one up to bf16 ties."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.config import EngineConfig  # noqa: E402
from kamado.engine.core import EngineCore  # noqa: E402
from kamado.engine.sampling_params import SamplingParams  # noqa: E402
from tests.gpu.test_cuda_engine import assert_same_up_to_bf16_ties  # noqa: E402

pytestmark = pytest.mark.gpu


def generate(speculation: str) -> tuple[dict[str, list], EngineCore]:
    engine = EngineCore(
        EngineConfig(
            model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
            kv_cache_bytes=1 << 30, max_num_seqs=8, speculation=speculation,
        )
    )  # fmt: skip
    logprobs = 2 if speculation == "off" else None
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=logprobs)
    for i in range(4):
        chunk = [(i * 7919 + j * 104729) % 30000 + 100 for j in range(40)]
        engine.add_request(str(i), chunk * 4, params)
    out: dict[str, list] = {str(i): [] for i in range(4)}
    while engine.has_work():
        for d in engine.step():
            out[d.request_id].extend(d.logprobs if logprobs is not None else d.new_token_ids)
    return out, engine


def test_greedy_output_with_speculation_follows_the_plain_one():
    reference, _ = generate("off")
    tokens, engine = generate("ngram")
    assert_same_up_to_bf16_ties(reference, tokens)
    stats = engine.snapshot()
    print(
        "spec on CUDA: drafted", stats.spec_drafted_tokens, "accepted", stats.spec_accepted_tokens
    )
    assert engine.pool.num_used == 0
