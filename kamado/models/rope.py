"""Rotary position embeddings (HF rotate-half layout), including llama3-style scaling."""

from __future__ import annotations

import math

import torch

from kamado.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        inv_freq = _llama3_scale(inv_freq, scaling)
    elif kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind not in ("default", None):
        raise ValueError(f"unsupported rope scaling {kind!r} (supported: default, linear, llama3)")
    return inv_freq.float()


def _llama3_scale(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables indexed by position; grown on demand."""

    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(config).to(device)
        self.cos = self.sin = torch.empty(0, device=device)
        self.held = False  # see hold()
        self._grow(min(config.max_position_embeddings, 8192))

    def reserve(self, length: int) -> None:
        """Make tables for positions below `length` (the caller knows them on the host, so
        the step itself needs no device-to-host read and can be captured in a graph)."""
        if length <= self.cos.shape[0]:
            return
        if self.held:
            raise RuntimeError(
                f"rotary tables hold {self.cos.shape[0]} positions and CUDA graphs read "
                f"them where they are: position {length - 1} would move them"
            )
        self._grow(max(length, 2 * self.cos.shape[0]))

    def hold(self, length: int) -> None:
        """Reserve `length` positions and never move the tables again: a CUDA graph
        captured from here on reads them at their addresses, so new tables would leave
        it reading freed memory (whatever was allocated there next)."""
        self.reserve(length)
        self.held = True

    def _grow(self, length: int) -> None:
        t = torch.arange(length, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, KVH, D] -> rotated copies; positions below reserve()'s."""
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
