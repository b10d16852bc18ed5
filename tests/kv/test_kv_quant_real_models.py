"""Real models (GGUF through PyPI) with a quantized KV cache against transformers' greedy
tokens (float32 both), over kamado bench's fixed prompt set: agreement printed, and held
above floors set from measurement.

Two figures: greedy agreement (each continuation counted up to its first differing token:
after it the two continue from different text) and teacher-forced top-1 agreement (the
share of transformers' tokens that are kamado's pick given the same preceding tokens).
Greedy agreement of small models is decided by a few near-ties early in a continuation:
smollm2 in bf16 with an unquantized cache agrees on only 80 % of tokens with itself in
float32 (top-1 98.2 %), so its int8 floor cannot be 90 %. Measured: see FLOORS' comment.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kamado import LLM
from kamado.bench.kv_cache import (
    AGREEMENT_PROMPTS,
    AGREEMENT_TOKENS,
    agreement,
    greedy_continuations,
    top1_agreement,
)
from tests.engine.conftest import hf_greedy

# Slow: transformers' reference, then 16 continuations and 512 teacher-forced picks per run.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# (greedy, top-1) floors. Measured against transformers: smollm2 int8 73.9 % / 98.6 %, fp8
# 63.9 % / 97.2 %, fp8-static 64.7 % / 95.8 % (2026-12-05). qwen2.5-coder-0.5b, against
# kamado bf16 with an unquantized cache (its run against transformers did not finish on the
# loaded dev machine): int8 78.9 % / 97.7 %, fp8 62.0 % / 97.7 % (2026-11-30; 60.3 % /
# 96.7 % and 58.7 % / 96.9 % on 2026-12-05, fp8-static 59.9 % / 97.5 %).
FLOORS = {"int8": (0.60, 0.96), "fp8": (0.50, 0.95), "fp8-static": (0.50, 0.94)}


# smollm2 only: qwen2.5-coder-0.5b against transformers in float32 takes longer than the
# whole suite may (its figures come from `kamado bench --kv-cache`, committed).
@pytest.fixture(scope="module", params=["smollm2"])
def reference_run(request):
    """The model, the prompts as its token ids, and transformers' greedy continuations."""
    path = request.getfixturevalue(f"{request.param}_path")
    llm = LLM(str(path), dtype="float32", kv_cache_bytes=16 << 20)
    prompts = [llm.tokenizer.encode(p) for p in AGREEMENT_PROMPTS]
    eos = sorted(llm.engine.eos_token_ids)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    expected = [hf_greedy(model, ids, AGREEMENT_TOKENS, eos) for ids in prompts]
    return request.param, path, prompts, expected


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8-static"])
def test_greedy_tokens_agree_with_transformers(reference_run, kv_cache_dtype):
    name, path, prompts, expected = reference_run
    llm = LLM(str(path), dtype="float32", kv_cache_bytes=64 << 20, kv_cache_dtype=kv_cache_dtype)
    ours = greedy_continuations(llm.engine, prompts, AGREEMENT_TOKENS)
    share, identical = agreement(ours, expected)
    top1 = top1_agreement(llm.engine, prompts, expected)
    print(
        f"\n{name} kv {kv_cache_dtype}: greedy {share:.1%} of {sum(map(len, expected))} tokens "
        f"({identical}/{len(prompts)} continuations identical), top-1 {top1:.2%}"
    )
    greedy_floor, top1_floor = FLOORS[kv_cache_dtype]
    assert share >= greedy_floor
    assert top1 >= top1_floor
