"""GGUF quantized blocks -> kamado's int8 / int4 layouts, bit for bit (no float weights).

Each llama.cpp block type is integers times a per-block scale (plus a per-block minimum for
the *_1 and K types), so it maps exactly onto a grouped format:
- Q8_0 (32 x int8, fp16 d)           -> int8, group 32, scale d
- Q5_0 (32 x 5 bits, fp16 d)         -> int8, group 32, q - 16, scale d
- Q4_0 (32 x 4 bits, fp16 d)         -> int4, group 32, scale d, min -8d
- Q4_1 (32 x 4 bits, fp16 d and m)   -> int4, group 32, scale d, min m
- Q4_K (256: 8 sub-blocks of 32 with 6-bit scales and mins) -> int4, group 32,
  scale d * sc, min -dmin * m
Input: a tensor's raw bytes shaped (rows, bytes_per_row). Scales come out float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as T


@dataclass
class Repacked:
    q: np.ndarray  # int8 [rows, in] (int8 kind) or uint8 values 0..15 (int4 kind)
    scales: np.ndarray  # float32 [rows, in // 32]
    mins: np.ndarray | None  # float32 [rows, in // 32] for int4, else None

    @property
    def kind(self) -> str:
        return "int4" if self.mins is not None else "int8"


def _blocks(raw: np.ndarray, block_bytes: int) -> np.ndarray:
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The fp16 field at `offset` of every block, as float32 [rows, blocks]."""
    return blocks[..., offset : offset + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 values: low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _flat(values: np.ndarray) -> np.ndarray:
    return values.reshape(values.shape[0], -1)


def q8_0(raw: np.ndarray) -> Repacked:
    b = _blocks(raw, 34)
    return Repacked(_flat(b[..., 2:].view(np.int8)), _f16(b, 0), None)


def q5_0(raw: np.ndarray) -> Repacked:
    b = _blocks(raw, 22)
    high = np.unpackbits(b[..., 2:6], axis=-1, bitorder="little")  # bit j of qh: element j
    q = _nibbles(b[..., 6:]) | (high << 4)
    return Repacked(_flat(q.astype(np.int16) - 16).astype(np.int8), _f16(b, 0), None)


def q4_0(raw: np.ndarray) -> Repacked:
    b = _blocks(raw, 18)
    d = _f16(b, 0)
    return Repacked(_flat(_nibbles(b[..., 2:])), d, -8 * d)


def q4_1(raw: np.ndarray) -> Repacked:
    b = _blocks(raw, 20)
    return Repacked(_flat(_nibbles(b[..., 4:])), _f16(b, 0), _f16(b, 2))


def q4_k(raw: np.ndarray) -> Repacked:
    b = _blocks(raw, 144)
    d, dmin = _f16(b, 0)[..., None], _f16(b, 2)[..., None]
    s = b[..., 4:16]
    # llama.cpp's get_scale_min_k4: sub-blocks 0-3 use the low 6 bits of bytes 0-3 (scale)
    # and 4-7 (min); 4-7 combine a nibble of bytes 8-11 with the top 2 bits of bytes 0-7.
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    m = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    qs = b[..., 16:].reshape(*b.shape[:2], 4, 32)  # 4 chunks of 32 bytes = 64 values each
    q = np.stack([qs & 15, qs >> 4], axis=-2)  # [rows, blocks, 4, 2, 32]: sub-block 2j, 2j+1
    scales = (d * sc.astype(np.float32)).reshape(raw.shape[0], -1)
    mins = (-dmin * m.astype(np.float32)).reshape(raw.shape[0], -1)
    return Repacked(_flat(q), scales, mins)


REPACKERS = {T.Q8_0: q8_0, T.Q5_0: q5_0, T.Q4_0: q4_0, T.Q4_1: q4_1, T.Q4_K: q4_k}
# The layout each type repacks to (all in groups of 32): tensors of one layout concatenate.
LAYOUTS = {T.Q8_0: "int8", T.Q5_0: "int8", T.Q4_0: "int4", T.Q4_1: "int4", T.Q4_K: "int4"}
