"""One Triton launch that sets to -inf every logit whose bit in llguidance's packed mask
is clear: on a CPU-bound decode step each torch op the unpacking would take (and, compare,
masked fill) costs host time, so they are one kernel here."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens a program masks: 128 words of the packed row


@triton.jit
def _mask_logits(logits_ptr, logits_stride, bits_ptr, bits_stride, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(bits_ptr + row * bits_stride + tokens // 32, mask=in_vocab, other=-1)
    forbidden = ((words >> (tokens % 32)) & 1) == 0
    minus_inf = tl.full([BLOCK], float("-inf"), tl.float32)
    tl.store(logits_ptr + row * logits_stride + tokens, minus_inf, mask=in_vocab & forbidden)


def mask_logits(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Mask `logits` [n, vocab] in place by the packed int32 `bits` [n, words]."""
    n, vocab = logits.shape
    assert logits.stride(1) == 1 and bits.stride(1) == 1 and bits.dtype == torch.int32
    grid = (n, triton.cdiv(vocab, BLOCK))
    _mask_logits[grid](logits, logits.stride(0), bits, bits.stride(0), vocab, BLOCK=BLOCK)
