"""Packed token masks unpack to the tokens numpy's own bit unpacking says are allowed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kamado.structured.bitmask import ALL_ALLOWED, TokenBitmask

VOCAB = 1000  # not a multiple of 32: the last word's spare bits must be ignored


def masked_logits(
    bitmask: TokenBitmask, device: str, rows: int, seed: int
) -> tuple[torch.Tensor, np.ndarray]:
    """Random masks applied to ones; also the allowed tokens by numpy, as [rows, VOCAB]."""
    rng = np.random.default_rng(seed)
    bits = bitmask.rows(rows)
    packed = rng.integers(-(2**31), 2**31, size=(rows, bitmask.words), dtype=np.int64)
    bits.copy_(torch.from_numpy(packed.astype(np.int32)))
    if rows > 1:
        bits[rows - 1] = ALL_ALLOWED  # the row of a sequence without a constraint
    logits = torch.ones(rows, VOCAB, device=device)
    bitmask.apply(logits)
    as_bytes = bits.numpy().view(np.uint8)
    allowed = np.unpackbits(as_bytes, axis=1, bitorder="little")[:, :VOCAB].astype(bool)
    return logits.cpu(), allowed


def check(logits: torch.Tensor, allowed: np.ndarray) -> None:
    assert np.array_equal(torch.isfinite(logits).numpy(), allowed)
    assert allowed[0].any() and not allowed[0].all()
    if len(allowed) > 1:
        assert allowed[-1].all()


@pytest.mark.parametrize("rows", [1, 5])
def test_forbidden_tokens_are_minus_inf_and_the_rest_untouched(rows):
    bitmask = TokenBitmask(VOCAB, torch.device("cpu"))
    logits, allowed = masked_logits(bitmask, "cpu", rows, seed=rows)
    check(logits, allowed)
    assert (logits[torch.isfinite(logits)] == 1).all()


def test_the_buffer_grows_and_keeps_being_reused():
    bitmask = TokenBitmask(VOCAB, torch.device("cpu"))
    first = bitmask.rows(2)
    assert bitmask.rows(1).data_ptr() == first.data_ptr()
    assert bitmask.rows(7).shape == (7, bitmask.words)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_masks_apply_on_the_gpu_from_a_pinned_buffer():
    bitmask = TokenBitmask(VOCAB, torch.device("cuda"))
    assert bitmask.rows(3).is_pinned()
    for seed in range(3):  # reuse: each step's copy must see that step's bits
        logits, allowed = masked_logits(bitmask, "cuda", 3, seed)
        check(logits, allowed)
