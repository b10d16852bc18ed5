"""Grammar-constrained decoding: constraints as plain data, llguidance matchers in the engine.

llguidance is imported only where a constraint is compiled or matched, so the engine (and
`kamado bench`) still import on machines without it.
"""

from kamado.structured.constraint import Constraint, ConstraintError

__all__ = ["Constraint", "ConstraintError"]
