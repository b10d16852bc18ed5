"""The surgery pipeline: named steps chosen by `--surgery a,b,c`, applied while the model
loads, each reporting the memory it saved.

Steps run in stage order whatever the order on the command line: keep-quantized GGUF
weights are read first, then projections are fused, then weights are compressed (so the
fused matrices are compressed whole). The KV-cache names (kv-fp8, kv-fp8-static, kv-int8)
are not weight steps: they set EngineConfig.kv_cache_dtype (see kv.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from kamado.config import ModelConfig
from kamado.models.source import ModelSource

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadTarget:
    """What a step may need to know about the model being loaded."""

    source: ModelSource
    config: ModelConfig
    dtype: torch.dtype
    device: str


@dataclass
class StepReport:
    name: str
    bytes_saved: int = 0
    details: list[str] = field(default_factory=list)

    def line(self) -> str:
        text = f"surgery {self.name}: {self.bytes_saved / 2**20:,.1f} MiB saved"
        return text + (f" ({'; '.join(self.details)})" if self.details else "")


class SurgeryStep(Protocol):
    name: str
    stage: int  # 0 load-format, 1 fusion, 2 weight compression
    # Weights (HF names) the loader must not read: the step builds them itself.
    skip_loading: frozenset[str]

    def apply(self, unit: nn.Module, prefix: str, report: StepReport) -> None:
        """Transform one unit in place: a DecoderLayer (prefix 'model.layers.N.') or, once
        every layer is done, the whole Transformer (prefix '') for the output head."""
        ...


def linear_slots(unit: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    """The projections a unit computes with, as (parent, attribute, HF module name)."""
    from kamado.models.transformer import DecoderLayer, Transformer

    if isinstance(unit, Transformer):
        return [] if unit.config.tie_word_embeddings else [(unit, "lm_head", "lm_head")]
    assert isinstance(unit, DecoderLayer)
    attn, mlp = unit.self_attn, unit.mlp
    qkv = ["qkv_proj"] if attn.qkv_proj is not None else ["q_proj", "k_proj", "v_proj"]
    gate_up = ["gate_up_proj"] if mlp.gate_up_proj is not None else ["gate_proj", "up_proj"]
    slots = [(attn, n, f"{prefix}self_attn.{n}") for n in [*qkv, "o_proj"]]
    return slots + [(mlp, n, f"{prefix}mlp.{n}") for n in [*gate_up, "down_proj"]]


# A fused projection's parts only hold views of its weight; replacing it drops them too.
FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def replace_linear(parent: nn.Module, attr: str, new: nn.Module) -> int:
    """Put `new` where `parent.attr` was; returns the bytes that frees."""
    saved = module_bytes(getattr(parent, attr)) - module_bytes(new)
    setattr(parent, attr, new)
    for part in FUSED_PARTS.get(attr, ()):
        setattr(parent, part, None)
    return saved


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes held by tensors, each storage counted once (fused weights and their views,
    tied embeddings); tensors not yet loaded (meta) count at their full size."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        if t.device.type == "meta":
            total += t.numel() * t.element_size()
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def module_bytes(module: nn.Module) -> int:
    return tensor_bytes([*module.parameters(), *module.buffers()])
