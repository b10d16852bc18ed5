"""One decoder-only transformer for Llama, Mistral, Qwen2 and Qwen3.

Architecture differences are configuration (qkv bias, qk-norm, tied embeddings, rope
scaling), not separate files. The model works on a flattened batch: all new tokens of
all sequences in one [T] tensor, with attention reading and writing the paged KV cache.
Module names follow Hugging Face so checkpoints load by name. Load-time surgery
(kamado.surgery) may add fused `qkv_proj` / `gate_up_proj` projections and swap any
projection for a compressed one; the forward pass uses whichever is there. On the CPU
its matmuls take rows rounded up to a few buckets (row_buckets).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kamado.attention.backend import AttentionBackend
from kamado.config import ModelConfig
from kamado.kv.cache import KVCache
from kamado.models.rope import RotaryEmbedding
from kamado.models.row_buckets import padded_rows


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 like the reference implementations, then cast back.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        hidden, q_dim = config.hidden_size, config.num_heads * config.head_dim
        kv_dim = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q_dim, hidden, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k and v in one matmul, set by surgery
        self.split = (q_dim, kv_dim, kv_dim)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        x = padded_rows(x)
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x)[:t].split(self.split, dim=-1)
        else:
            q, k, v = self.q_proj(x)[:t], self.k_proj(x)[:t], self.v_proj(x)[:t]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ctx.rope(positions, q, k)
        out = ctx.backend.forward(q, k, v, self.layer, ctx.cache, ctx.metadata)
        return self.o_proj(padded_rows(out.reshape(t, self.num_heads * self.head_dim)))[:t]


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up in one matmul, set by surgery

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = padded_rows(x)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)[:t]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


# The residual stream between layers: the hidden states, and where a pass keeps the
# residual apart from them (the fused pass adds it inside its next norm), that residual.
LayerState = tuple[torch.Tensor, torch.Tensor | None]


class ForwardPass(Protocol):
    """A forward pass in three parts, so a prompt chunk can run a few layers per step:
    `embed`, then `run_layers` over consecutive ranges of layers, then `final_norm`."""

    num_layers: int

    def embed(self, input_ids: torch.Tensor) -> LayerState: ...

    def run_layers(
        self, state: LayerState, positions: torch.Tensor, ctx: StepContext, layers: range
    ) -> LayerState: ...

    def final_norm(self, state: LayerState) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden states [T, hidden] -> float32 logits [T, vocab]."""
        ...

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor: ...


def full_pass(
    forward: ForwardPass, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
) -> torch.Tensor:
    """input_ids, positions: [T] -> final hidden states [T, hidden], through every layer."""
    state = forward.embed(input_ids)
    state = forward.run_layers(state, positions, ctx, range(forward.num_layers))
    return forward.final_norm(state)


def join_states(first: LayerState, then: LayerState) -> LayerState:
    """One state holding the rows of `first`, then those of `then` (both after as many
    layers, so both keep their residual apart or neither does)."""
    (x1, r1), (x2, r2) = first, then
    assert (r1 is None) == (r2 is None)
    return torch.cat([x1, x2]), None if r1 is None or r2 is None else torch.cat([r1, r2])


def split_state(state: LayerState, num_rows: int) -> tuple[LayerState, LayerState]:
    """The first `num_rows` rows of a state, and the rest."""
    x, r = state
    first = (x[:num_rows], None if r is None else r[:num_rows])
    return first, (x[num_rows:], None if r is None else r[num_rows:])


class StepContext:
    """What every layer needs for one forward pass besides its input."""

    def __init__(
        self, rope: RotaryEmbedding, backend: AttentionBackend, cache: KVCache, metadata: Any
    ) -> None:
        self.rope, self.backend, self.cache, self.metadata = rope, backend, cache, metadata


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Take tensors by Hugging Face name; every parameter must be provided."""
        if self.config.tie_word_embeddings:
            weights = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"]}
        self.load_state_dict(weights, strict=True, assign=True)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        return full_pass(self, input_ids, positions, ctx)

    def embed(self, input_ids: torch.Tensor) -> LayerState:
        return self.model.embed_tokens(input_ids), None

    def run_layers(
        self, state: LayerState, positions: torch.Tensor, ctx: StepContext, layers: range
    ) -> LayerState:
        x, _ = state
        for i in layers:
            x = self.model.layers[i](x, positions, ctx)
        return x, None

    def final_norm(self, state: LayerState) -> torch.Tensor:
        return self.model.norm(state[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(padded_rows(hidden))[: hidden.shape[0]].float()
