"""A constrained sequence that is preempted and recomputed keeps its matcher state."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kamado import LLM, SamplingParams
from kamado.structured import Constraint
from tests.structured.conftest import chat_prompt
from tests.structured.schemas import arr, obj, s

pytestmark = pytest.mark.slow

SCHEMA = obj({"words": arr(s(12, minLength=6), 4, 4)})
QUESTIONS = ["Four animals.", "Four colours.", "Four fruits.", "Four countries.", "Four tools."]


def test_outputs_validate_and_match_across_preemptions(qwen05_path):
    params = SamplingParams(
        temperature=0.0, max_tokens=64, constraint=Constraint.json_schema(SCHEMA)
    )
    # float32, so that greedy tokens do not depend on how sequences are batched.
    roomy = LLM(str(qwen05_path), dtype="float32", kv_cache_bytes=64 << 20)
    prompts = [chat_prompt(roomy, q) for q in QUESTIONS]
    expected = [o.outputs[0].text for o in roomy.generate(prompts, params)]
    # 8 KV blocks of 16 tokens: the sequences outgrow them and are preempted mid-output.
    tight = LLM(str(qwen05_path), dtype="float32", kv_cache_bytes=3 << 20)
    outputs = tight.generate(prompts, params)
    assert tight.engine.snapshot().num_preemptions > 0
    for out, ref in zip(outputs, expected, strict=True):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
        assert out.outputs[0].text == ref
