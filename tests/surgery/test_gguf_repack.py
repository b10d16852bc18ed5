"""GGUF blocks repacked into int8/int4 layouts mean exactly what gguf-py's dequantize
reads from the same bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

from kamado.surgery import formats
from kamado.surgery.gguf_repack import REPACKERS


def random_blocks(qtype: T, rows: int, blocks: int) -> np.ndarray:
    """Random bytes with finite fp16 scales where the block keeps them."""
    _, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    halves = 2 if qtype in (T.Q4_1, T.Q4_K) else 1  # d (and m or dmin) lead the block
    scales = rng.uniform(-0.05, 0.05, (rows, blocks, halves)).astype(np.float16)
    raw[..., : 2 * halves] = scales.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(REPACKERS))
def test_repacked_weights_equal_gguf_dequantization(qtype):
    block, _ = GGML_QUANT_SIZES[qtype]
    raw = random_blocks(qtype, rows=6, blocks=512 // block)
    expected = dequantize(raw, qtype).reshape(6, 512)
    r = REPACKERS[qtype](raw)
    q, scales = torch.from_numpy(r.q), torch.from_numpy(r.scales)
    if r.mins is None:
        assert r.q.dtype == np.int8
        got = formats.dequantize_int8(q, scales)
    else:
        assert r.q.max() <= 15
        got = formats.dequantize_int4(q, scales, torch.from_numpy(r.mins))
    assert scales.shape == (6, 512 // 32)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-7)
