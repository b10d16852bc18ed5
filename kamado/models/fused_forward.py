"""The transformer's forward pass on CUDA with fused weights and kernels.

At build time q/k/v and gate/up weights are concatenated into one matrix each (one
matmul reads them all) and the module's own parameters become views of those matrices,
so nothing is stored twice and the Hugging Face names still resolve. Per layer a step is
then: add+RMSNorm, QKV matmul, qk-norm+rope in place, attention, o_proj, add+RMSNorm,
gate/up matmul, SiLU*up, down: about a dozen kernels instead of some sixty.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kamado.models.fused_kernels import qk_norm_rope, rms_norm, silu_mul
from kamado.models.transformer import StepContext, Transformer


def _fuse(modules: list[nn.Linear], attr: str) -> torch.Tensor | None:
    """Concatenate the modules' `attr` tensors; point each module at its slice."""
    parts = [getattr(m, attr) for m in modules]
    if parts[0] is None:
        return None
    fused = torch.cat([p.detach() for p in parts])
    start = 0
    for module, part in zip(modules, parts, strict=True):
        end = start + part.shape[0]
        setattr(module, attr, nn.Parameter(fused[start:end], requires_grad=False))
        start = end
    return fused


class FusedForward:
    def __init__(self, model: Transformer) -> None:
        self.model = model
        c = model.config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.eps = c.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            projections = [attn.q_proj, attn.k_proj, attn.v_proj]
            self.layers.append(
                dict(
                    input_norm=layer.input_layernorm.weight,
                    qkv=_fuse(projections, "weight"),
                    qkv_bias=_fuse(projections, "bias"),
                    q_norm=None if attn.q_norm is None else attn.q_norm.weight,
                    k_norm=None if attn.k_norm is None else attn.k_norm.weight,
                    o=attn.o_proj.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                    down=mlp.down_proj.weight,
                )
            )

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: StepContext
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], as Transformer."""
        t = input_ids.shape[0]
        q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        x = self.model.model.embed_tokens(input_ids)
        residual = None
        for i, w in enumerate(self.layers):
            h, residual = rms_norm(x, w["input_norm"], self.eps, residual)
            qkv = F.linear(h, w["qkv"], w["qkv_bias"])
            qk_norm_rope(
                qkv, positions, ctx.rope.cos, ctx.rope.sin, self.num_heads, self.num_kv_heads,
                self.head_dim, w["q_norm"], w["k_norm"], self.eps,
            )  # fmt: skip
            q = qkv[:, :q_dim].view(t, self.num_heads, self.head_dim)
            k = qkv[:, q_dim : q_dim + kv_dim].view(t, self.num_kv_heads, self.head_dim)
            v = qkv[:, q_dim + kv_dim :].view(t, self.num_kv_heads, self.head_dim)
            out = ctx.backend.forward(q, k, v, i, ctx.cache, ctx.metadata)
            x = F.linear(out.reshape(t, q_dim), w["o"])
            h, residual = rms_norm(x, w["post_norm"], self.eps, residual)
            x = F.linear(silu_mul(F.linear(h, w["gate_up"])), w["down"])
        hidden, _ = rms_norm(x, self.model.model.norm.weight, self.eps, residual)
        return hidden
