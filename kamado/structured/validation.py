"""Checking a constraint before it reaches the engine: size, compile errors, compile time.

llguidance's own limits (lexer fuel, grammar size) bound the work of every mask step in
the engine; this adds a cap on the text and a wall-clock limit on the compile, so a
pathological schema is refused here with a clear message instead of slowing the engine.
"""

from __future__ import annotations

import concurrent.futures

from kamado.structured.constraint import Constraint, ConstraintError

MAX_SOURCE_CHARS = 256 * 1024
COMPILE_TIMEOUT_S = 5.0

# Compiles run here so a slow one can be abandoned (llguidance releases the GIL meanwhile).
_compiler = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")


def _compile(constraint: Constraint) -> list[str]:
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(constraint.grammar())
    return messages if is_error else []


def check_constraint(constraint: Constraint, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
    """Raise ConstraintError (message names the problem) unless the constraint compiles in time."""
    if len(constraint.source) > MAX_SOURCE_CHARS:
        raise ConstraintError(
            f"it is {len(constraint.source)} characters; the limit is {MAX_SOURCE_CHARS}"
        )
    try:
        errors = _compiler.submit(_compile, constraint).result(timeout=timeout_s)
    except concurrent.futures.TimeoutError:
        raise ConstraintError(f"it did not compile within {timeout_s:g} s; simplify it") from None
    except ModuleNotFoundError:
        raise ConstraintError("this server was installed without llguidance") from None
    if errors:
        raise ConstraintError("; ".join(e.strip() for e in errors))
