"""The KV pool sized from the card: weights, activations and pool stay under the fraction."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.config import EngineConfig  # noqa: E402
from kamado.engine.llm import LLM  # noqa: E402
from kamado.engine.sampling_params import SamplingParams  # noqa: E402

pytestmark = pytest.mark.gpu


def test_kv_pool_fills_the_fraction_of_the_card_and_a_full_step_fits():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    _, total = torch.cuda.mem_get_info()
    fraction = torch.cuda.memory_reserved() / total + 0.2  # 20% of the card beyond this
    llm = LLM("synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16", gpu_memory_fraction=fraction)
    cache = llm.engine.runner.cache
    kv_bytes = sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))
    assert kv_bytes > 0.1 * total  # most of those 20% went to the pool
    # A step of max_num_batched_tokens prompt tokens runs, inside the fraction.
    prompt = list(range(100, 100 + EngineConfig().max_num_batched_tokens))
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 2
    assert torch.cuda.max_memory_reserved() <= fraction * total
