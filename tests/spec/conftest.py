"""Speculation tests reuse the engine tests' tiny models and helpers."""

from tests.engine.conftest import tiny_models  # noqa: F401  (a fixture)
