"""The transformer's forward pass on CUDA with fused weights and kernels.

It runs on a model whose q/k/v and gate/up projections the `fuse` surgery step has made
one matmul each (plain or compressed: each projection is called as a module). Per layer a
step is: add+RMSNorm, QKV matmul, qk-norm+rope in place (writing K and V into an
unquantized cache too), attention, o_proj, add+RMSNorm, gate/up matmul with SiLU*up (in
its epilogue where a GEMV does it), down: about ten kernels instead of some sixty.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from kamado.models.fused_kernels import qk_norm_rope, rms_norm
from kamado.models.transformer import LayerState, StepContext, Transformer, full_pass
from kamado.surgery.kernel_epilogues import silu_mul
from kamado.surgery.qlinear import QuantizedLinear
from kamado.surgery.triton_matmul import dense_matmul

Projection = Callable[[torch.Tensor], torch.Tensor]


def projection(module: nn.Module) -> Projection:
    """A plain linear as dense_matmul (a GEMV for decode-sized inputs); a compressed one is
    called as it is."""
    if type(module) is nn.Linear:
        return partial(dense_matmul, weight=module.weight, bias=module.bias)
    return module


def gated_projection(gate_up: nn.Module) -> Projection:
    """A fused gate/up projection followed by SiLU(gate) * up: in the GEMV's epilogue where
    a GEMV serves the weight and the input (one kernel instead of two), else silu_mul
    after the matmul."""
    if type(gate_up) is nn.Linear:
        return partial(dense_matmul, weight=gate_up.weight, bias=gate_up.bias, gated=True)
    if isinstance(gate_up, QuantizedLinear):
        return gate_up.silu_gated
    return lambda x: silu_mul(gate_up(x))  # RowConcat: parts in different formats


class FusedForward:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        c = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.num_layers = c.num_layers
        self.head = projection(model.lm_head)
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.qkv_proj is None or mlp.gate_up_proj is None:
                raise ValueError("FusedForward needs the fuse surgery step applied first")
            self.layers.append(
                dict(
                    input_norm=layer.input_layernorm.weight,
                    qkv=projection(attn.qkv_proj),
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                    o=projection(attn.o_proj),
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up_act=gated_projection(mlp.gate_up_proj),
                    down=projection(mlp.down_proj),
                )
            )

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], as Transformer."""
        return full_pass(self, input_ids, positions, ctx)

    def embed(self, input_ids: torch.Tensor) -> LayerState:
        return self.model.model.embed_tokens(input_ids), None

    def run_layers(
        self, state: LayerState, positions: torch.Tensor, ctx: StepContext, layers: range
    ) -> LayerState:
        """Layers in `layers`; the state is (the last MLP's output, the residual before it),
        kept apart so the next add+RMSNorm rounds as it does in one pass."""
        x, residual = state
        t = x.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        for i in layers:
            w = self.layers[i]
            h, residual = rms_norm(x, w["input_norm"], self.eps, residual)
            qkv = w["qkv"](h)
            kv_store = None
            if not ctx.cache.format.scaled:  # a quantized cache: the backend's store_kv
                kv_store = (ctx.cache.k[i], ctx.cache.v[i], ctx.metadata.slot_mapping)
            qk_norm_rope(
                qkv, positions, ctx.rope.cos, ctx.rope.sin, self.num_heads, self.num_kv_heads,
                self.head_dim, w["q_norm"], w["k_norm"], self.eps, kv_store,
            )  # fmt: skip
            q = qkv[:, :q_dim].view(t, self.num_heads, self.head_dim)
            k = qkv[:, q_dim : q_dim + kv_dim].view(t, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_dim + kv_dim :].view(t, self.num_kv_heads, self.head_dim)
            out = ctx.backend.forward(
                q, k, v, i, ctx.cache, ctx.metadata, kv_stored=kv_store is not None
            )
            x = w["o"](out.reshape(t, q_dim))
            h, residual = rms_norm(x, w["post_norm"], self.eps, residual)
            x = w["down"](w["gate_up_act"](h))
        return x, residual

    def final_norm(self, state: LayerState) -> torch.Tensor:
        x, residual = state
        hidden, _ = rms_norm(x, self.model.model.norm.weight, self.eps, residual)
        return hidden

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()
