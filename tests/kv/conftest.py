from tests.engine.conftest import tiny_models

__all__ = ["tiny_models"]
