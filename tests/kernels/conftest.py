"""Fixtures for the kernel tests that run without a GPU."""

from __future__ import annotations

import pytest


@pytest.fixture
def interpreted_widen(monkeypatch):
    """widen.py's kernels run by Triton's interpreter, on CPU tensors (it rounds float32
    to bf16 by truncation, not to nearest as the GPU does)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kamado.surgery import widen

    for name in ("_widen_scaled_kernel", "_widen_int4_kernel"):
        monkeypatch.setattr(widen, name, InterpretedFunction(getattr(widen, name).fn))
