"""Weight formats as plain tensors: how a float matrix becomes compressed values plus scales,
and the float matrix those stand for (the reference every matmul path is tested against).

All matrices are [out, in]; groups run along `in`, so every output row has its own scales.
- int8: w = q * scale, q in [-127, 127], one scale per row (group = in) or per group.
- int4: w = q * scale + min, q in [0, 15], per group (asymmetric, like GGUF Q4_1/Q4_K).
- fp8:  w = q * scale, q in float8 e4m3, one scale per row.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8 e4m3fn value


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    out, inp = w.shape
    if inp % group:
        raise ValueError(f"input size {inp} is not a multiple of the group size {group}")
    return w.detach().float().view(out, inp // group, group)


def quantize_int8(w: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scales float32 [out, in // group]); group None = one per row."""
    wg = _groups(w, group or w.shape[1])
    scales = wg.abs().amax(-1).clamp(min=1e-12) / 127
    q = (wg / scales[..., None]).round_().clamp_(-127, 127).to(torch.int8)
    return q.view(w.shape), scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    out, inp = q.shape
    group = inp // scales.shape[1]
    return (q.float().view(out, -1, group) * scales.float()[..., None]).view(out, inp)


def quantize_int4(
    w: torch.Tensor, group: int = 128, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q uint8 values 0..15 [out, in], scales, mins [out, in // group]), min-max per group.

    Scales and mins are rounded to scale_dtype first and q is computed from the rounded
    values, so dequantize_int4 of the result is exactly what the stored bytes mean."""
    wg = _groups(w, group)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = ((hi - lo) / 15).clamp(min=1e-8).to(scale_dtype)
    mins = lo.to(scale_dtype)
    q = ((wg - mins.float()[..., None]) / scales.float()[..., None]).round_().clamp_(0, 15)
    return q.to(torch.uint8).view(w.shape), scales, mins


def dequantize_int4(q: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    out, inp = q.shape
    group = inp // scales.shape[1]
    w = q.float().view(out, -1, group) * scales.float()[..., None] + mins.float()[..., None]
    return w.view(out, inp)


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q float8_e4m3fn [out, in], scales float32 [out]): each row's largest value maps to
    the format's largest."""
    wf = w.detach().float()
    scales = wf.abs().amax(-1).clamp(min=1e-12) / FP8_MAX
    return (wf / scales[:, None]).to(torch.float8_e4m3fn), scales


def dequantize_fp8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return q.float() * scales.float()[:, None]


# A group's inputs go into its words as bf16-sized pairs: word j of a group of G holds
# pairs j, W + j, 2W + j and 3W + j (W = G / 8 words), that is inputs p * G / 4 + 2j and
# + 1 for p = 0..3, as its elements 2p and 2p + 1. So the first pairs of all the words of
# a group are contiguous inputs, as are their second, third and fourth: a kernel loads a
# word's inputs as four whole pairs, in the same layout as the words.
# Bits 4i..4i+3 of a word hold its element WORD_ORDER[i]: the even elements in the low
# half, the odd ones in the high half, so one shift and mask of the word yields elements
# 2p and 2p + 1 side by side (what the CUDA kernel's tensor cores read as a pair).
WORD_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PAIRS_PER_WORD = 4


def pack_int4(q: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 values 0..15 [out, in] in groups of `group` -> int32 words [out, in // 8]:
    each group's words in the pair order above, each word's elements in WORD_ORDER."""
    out, inp = q.shape
    if group % 8 or inp % group:
        raise ValueError(f"int4 groups of {group} do not pack {inp} inputs into whole words")
    words = group // 8
    pairs = q.view(out, inp // group, PAIRS_PER_WORD, words, 2).transpose(2, 3)
    order = torch.tensor(WORD_ORDER, device=q.device)
    nibbles = pairs.reshape(out, inp // 8, 8)[..., order].to(torch.int32)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return (nibbles << shifts).sum(-1, dtype=torch.int32)  # disjoint bits: the sum is an OR


def pack_int4_scale_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Each group's scale and min [out, groups] -> bf16 [out, groups, 2], side by side, the
    layout the CUDA kernels read beside pack_int4's words."""
    return torch.stack([scales, mins], dim=-1).to(torch.bfloat16)
