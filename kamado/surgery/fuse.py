"""Step `fuse`: q/k/v and gate/up projections as one matmul each (one weight read, one
launch). The fused matrix is the only copy: the original modules' parameters become views
of its slices, so Hugging Face names still resolve and nothing is stored twice. Parts that
are already compressed in different formats run side by side instead (RowConcat)."""

from __future__ import annotations

import torch
from torch import nn

from kamado.models.transformer import DecoderLayer
from kamado.surgery.pipeline import LoadTarget, StepReport
from kamado.surgery.qlinear import RowConcat


class FuseStep:
    name = "fuse"
    stage = 1
    skip_loading: frozenset[str] = frozenset()

    def __init__(self, target: LoadTarget) -> None:
        del target  # fusion works on whatever was loaded

    def apply(self, unit: nn.Module, prefix: str, report: StepReport) -> None:
        if isinstance(unit, DecoderLayer):
            fuse_layer(unit)
            if prefix == "model.layers.0.":
                report.details.append("q/k/v and gate/up fused in every layer")


def fuse_layer(layer: DecoderLayer) -> None:
    attn, mlp = layer.self_attn, layer.mlp
    if attn.qkv_proj is None:
        attn.qkv_proj = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    if mlp.gate_up_proj is None:
        mlp.gate_up_proj = fuse_rows([mlp.gate_proj, mlp.up_proj])


def fuse_rows(parts: list[nn.Module]) -> nn.Module:
    """One module computing all parts' outputs, concatenated."""
    if not all(type(p) is nn.Linear for p in parts):
        return RowConcat(parts)
    with torch.device("meta"):
        fused = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts))
    fused.weight = _fuse(parts, "weight")
    fused.bias = _fuse(parts, "bias")
    return fused


def _fuse(modules: list[nn.Linear], attr: str) -> nn.Parameter | None:
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
    return nn.Parameter(fused, requires_grad=False)
