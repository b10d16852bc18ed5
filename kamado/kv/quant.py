"""KV cache storage formats: the model's own dtype, or 8-bit codes (int8, fp8 e4m3) with
scales: one float32 scale per token and kv head (int8, fp8), or one calibrated scale per
layer and kv head (fp8-static).

Why one scale per (token, kv head): a token's K/V is written once, when it is computed, and
never changes. A scale taken from that head vector alone needs no calibration data, never
has to be rewritten as the context grows (a per-channel scale over tokens would), and
follows the large token-to-token swings in magnitude (attention-sink tokens, outliers)
that a static per-tensor scale would either clip or spend its range on. It costs 4 bytes
per head_dim codes: 4 / head_dim bytes per element (3.1 % at head_dim 128, 6.3 % at 64).

fp8 needs the scale too: e4m3's normal range starts at 2^-6, and V vectors of real models
sit largely below it, where e4m3 keeps only a few bits. And a scale of the vector's own
largest value stores that value exactly (as 448), where a coarser one rounds it by up to
1/16: a power-of-two scale per token lost as much fidelity as a static one
(`scripts/kv_fp8_scales.py`).

fp8-static drops the per-token bytes, so the cache holds exactly twice the tokens of a
16-bit one: the scales come from the model's own K/V over a calibration text when it
loads (kv/calibration.py), with headroom. e4m3's exponent still follows token-to-token
swings in magnitude; what it gives up is the exact largest value (fidelity side by side in
README, "Quantized KV cache").
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from kamado.config import KV_CACHE_DTYPES

log = logging.getLogger(__name__)

INT8_MAX = 127.0
FP8_MAX = 448.0  # largest finite float8_e4m3fn
# Smallest normal float32: the scale of an all-zero (or denormal) vector, so codes stay finite.
MIN_SCALE = torch.finfo(torch.float32).tiny


@dataclass(frozen=True)
class KVFormat:
    name: str  # auto | int8 | fp8 | fp8-static
    storage: torch.dtype  # element dtype of the cache tensors
    qmax: float | None  # largest code magnitude; None: stored as is, no scales
    static: bool = False  # one scale per (layer, kv head), not one per token
    # A static format's scales once calibrated: [2 (K, V), layers, kv_heads] float32.
    scales: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def scaled(self) -> bool:
        return self.qmax is not None

    @property
    def per_token(self) -> bool:
        """Whether each token's scales are stored beside its codes."""
        return self.scaled and not self.static

    @property
    def label(self) -> str:
        """What the cache holds, for people: int8, fp8, or the model dtype's name."""
        return self.name if self.scaled else str(self.storage).removeprefix("torch.")


def kv_format(name: str, model_dtype: torch.dtype, device: torch.device | str) -> KVFormat:
    """The format for `--kv-cache-dtype name`. fp8 on a CUDA device without fp8 conversions
    (compute capability below 8.9) becomes int8. On CPU fp8 is allowed: torch stores and
    converts float8_e4m3fn there in software (slower to read back than int8, same bytes)."""
    if name == "auto":
        return KVFormat("auto", model_dtype, None)
    if name == "int8":
        return KVFormat("int8", torch.int8, INT8_MAX)
    if name == "fp8":
        if not _has_fp8(device):
            log.warning("this GPU has no fp8 conversions: the KV cache is stored as int8")
            return KVFormat("int8", torch.int8, INT8_MAX)
        return KVFormat("fp8", torch.float8_e4m3fn, FP8_MAX)
    if name == "fp8-static":
        if not _has_fp8(device):
            raise ValueError(
                "--kv-cache-dtype fp8-static needs fp8 conversions (compute capability 8.9 "
                "or newer); this GPU has none: use int8"
            )
        return KVFormat("fp8-static", torch.float8_e4m3fn, FP8_MAX, static=True)
    raise ValueError(f"unknown KV cache dtype {name!r}; available: {', '.join(KV_CACHE_DTYPES)}")


def _has_fp8(device: torch.device | str) -> bool:
    device = torch.device(device)
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def quantize(
    x: torch.Tensor, fmt: KVFormat, scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> codes of the same shape in fmt.storage, and float32 scales [...]
    with x ~= codes * scale: `scale` where given (a static format's, [kv_heads]), else one
    per vector. Rounds to nearest (ties to even), as the Triton store does; values past
    the codes' range are clamped to it."""
    assert fmt.qmax is not None
    xf = x.float()
    if scale is None:
        scale = (xf.abs().amax(dim=-1) / fmt.qmax).clamp_min(MIN_SCALE)
    y = (xf / scale[..., None]).clamp(-fmt.qmax, fmt.qmax)
    codes = y.round().to(torch.int8) if fmt.storage == torch.int8 else y.to(fmt.storage)
    return codes, scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] and scales [...] back to values in `dtype` (multiplied in float32)."""
    return (codes.float() * scale[..., None]).to(dtype)
