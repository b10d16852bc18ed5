"""Constrained outputs of a real model (qwen2.5-coder-0.5b) all validate with jsonschema."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kamado import SamplingParams
from kamado.structured import Constraint
from tests.structured.conftest import chat_prompt
from tests.structured.schemas import CASES

pytestmark = pytest.mark.slow


def test_outputs_of_54_schemas_validate(qwen_llm):
    assert len(CASES) >= 50
    prompts = [chat_prompt(qwen_llm, question) for question, _ in CASES]
    params = [
        SamplingParams(temperature=0.0, max_tokens=96, constraint=Constraint.json_schema(schema))
        for _, schema in CASES
    ]
    outputs = qwen_llm.generate(prompts, params)
    for (question, schema), out in zip(CASES, outputs, strict=True):
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", (question, choice.text)
        jsonschema.validate(json.loads(choice.text), schema)


def test_json_object_regex_and_lark_constraints(qwen_llm):
    lark = 'start: "def " NAME "(" ")" ":"\nNAME: /[a-z_]{1,12}/'
    cases = [
        (
            "A cat's name and age, nothing else.",
            Constraint("json_object"),
            lambda t: isinstance(json.loads(t), dict),
        ),
        (
            "What is 6 times 7?",
            Constraint("regex", "[0-9]{1,3}"),
            re.compile("[0-9]{1,3}").fullmatch,
        ),
        (
            "Name a function.",
            Constraint("lark", lark),
            re.compile(r"def [a-z_]{1,12}\(\):").fullmatch,
        ),
    ]
    prompts = [chat_prompt(qwen_llm, q) for q, _, _ in cases]
    params = [SamplingParams(temperature=0.0, max_tokens=64, constraint=c) for _, c, _ in cases]
    for (_, _, ok), out in zip(cases, qwen_llm.generate(prompts, params), strict=True):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        assert ok(out.outputs[0].text), out.outputs[0].text


def test_sampled_choices_each_follow_the_grammar(qwen_llm):
    """n > 1 forks choices from one prefill; each has its own matcher."""
    schema = CASES[0][1]
    params = SamplingParams(
        n=4, temperature=1.0, seed=7, max_tokens=96, constraint=Constraint.json_schema(schema)
    )
    (out,) = qwen_llm.generate([chat_prompt(qwen_llm, CASES[0][0])], params)
    for choice in out.outputs:
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), schema)


def test_unconstrained_batch_mates_are_untouched(qwen_llm):
    prompt = chat_prompt(qwen_llm, "Say hello.")
    free = SamplingParams(temperature=0.0, max_tokens=12)
    alone = qwen_llm.generate([prompt], free)[0].outputs[0].token_ids
    constrained = SamplingParams(
        temperature=0.0, max_tokens=12, constraint=Constraint("json_object")
    )
    mixed = qwen_llm.generate([prompt, prompt], [free, constrained])
    assert mixed[0].outputs[0].token_ids == alone
    assert mixed[1].outputs[0].text.startswith("{")
