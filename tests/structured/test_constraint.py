"""Constraints as plain data, and their checks before they reach the engine."""

from __future__ import annotations

import pickle

import pytest

from kamado.engine.sampling_params import SamplingParams
from kamado.structured import Constraint, ConstraintError
from kamado.structured.validation import MAX_SOURCE_CHARS, check_constraint


def test_constraint_travels_to_the_engine_process_by_pickle():
    params = SamplingParams(constraint=Constraint.json_schema({"type": "integer"}))
    copy = pickle.loads(pickle.dumps(params))
    assert copy.constraint == params.constraint
    assert copy.constraint.grammar() == params.constraint.grammar()


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_object"),
        Constraint.json_schema({"type": "object", "properties": {"a": {"type": "string"}}}),
        Constraint("regex", "[a-z]+@[a-z]+\\.com"),
        Constraint("lark", 'start: "yes" | "no"'),
    ],
)
def test_valid_constraints_pass(constraint):
    check_constraint(constraint)


@pytest.mark.parametrize(
    ("constraint", "named"),
    [
        (Constraint.json_schema({"type": "objekt"}), "objekt"),
        (Constraint.json_schema({"properties": {"a": {"$ref": "#/$defs/missing"}}}), "missing"),
        (Constraint.json_schema({"type": "string", "pattern": "(("}), "unclosed group"),
        (Constraint("json_schema", "{not json"), "key must be a string"),
        (Constraint("regex", "[a-"), "unclosed character class"),
        (Constraint("lark", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_invalid_constraints_are_refused_with_the_reason(constraint, named):
    with pytest.raises(ConstraintError, match=named):
        check_constraint(constraint)


def test_oversized_constraint_is_refused_before_compiling():
    big = Constraint("regex", "a" * (MAX_SOURCE_CHARS + 1))
    with pytest.raises(ConstraintError, match="limit"):
        check_constraint(big)


def test_slow_compile_is_refused():
    # Many alternatives of nested repetition: valid, but not compiled within a tiny budget.
    lark = "start: " + " | ".join(f'"{i}" /[a-z]{{1,{i}}}/' for i in range(1, 3000))
    with pytest.raises(ConstraintError, match="did not compile"):
        check_constraint(Constraint("lark", lark), timeout_s=0.001)
