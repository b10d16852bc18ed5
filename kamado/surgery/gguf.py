"""Step `gguf`: serve a GGUF file's quantized projections as stored.

Without it the loader dequantizes every tensor to the serving dtype. With it, projections
stored as Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K are never read by the loader: this step repacks
their blocks into int8 / int4 layers (gguf_repack.py), exactly, with no float copy of the
weight ever made. Tensors of other types (F16, F32, Q6_K, ...) load as before. The token
table stored in such a type is kept too (qembedding), and a head tied to it computes from
its values.

q/k/v, and gate/up, that all repack to one layout become one layer here, their rows
concatenated: one matmul instead of several, as the fuse step does for float weights. It
has to happen here, as a built layer may hold its weight only in a kernel's packed form
(cpu_matmul).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch import nn

from kamado.models.gguf_loader import gguf_name, permuted_heads, unpermute_rows
from kamado.models.gguf_reader import GGUFFile
from kamado.models.layout import expected_weights
from kamado.models.transformer import DecoderLayer
from kamado.surgery.gguf_repack import LAYOUTS, REPACKERS, Repacked
from kamado.surgery.pipeline import (
    FUSED_PARTS,
    LoadTarget,
    StepReport,
    linear_slots,
    module_bytes,
    replace_linear,
    tensor_bytes,
)
from kamado.surgery.qembedding import GroupedEmbedding
from kamado.surgery.qlinear import Int4Linear, Int8Linear

EMBEDDING = "model.embed_tokens.weight"


class GGUFStep:
    name = "gguf"
    stage = 0

    def __init__(self, target: LoadTarget) -> None:
        if target.source.kind != "gguf" or target.source.path is None:
            raise ValueError("surgery gguf keeps a GGUF file's quantized tensors: the model "
                             f"{target.source.name!r} is not a GGUF file")  # fmt: skip
        self.target = target
        self.file = GGUFFile(target.source.path)
        self.kept: dict[str, str] = {}  # HF weight name -> GGUF tensor name
        for name in expected_weights(target.config):
            if name.endswith("proj.weight") or name in (EMBEDDING, "lm_head.weight"):
                stored = gguf_name(name)
                if self.file.tensors[stored].ggml_type in REPACKERS:
                    self.kept[name] = stored
        self.skip_loading = frozenset(self.kept)
        self.types: Counter[str] = Counter()

    def apply(self, unit: nn.Module, prefix: str, report: StepReport) -> None:
        if isinstance(unit, DecoderLayer):
            for parent, name, fused in [
                (unit.self_attn, f"{prefix}self_attn", "qkv_proj"),
                (unit.mlp, f"{prefix}mlp", "gate_up_proj"),
            ]:
                report.bytes_saved += self._fuse(parent, name, fused)
        for parent, attr, name in linear_slots(unit, prefix):
            stored = self.kept.get(f"{name}.weight")
            if stored is not None:
                module = self._module([stored], getattr(parent, attr).bias)
                report.bytes_saved += replace_linear(parent, attr, module)
        if prefix == "" and EMBEDDING in self.kept:
            report.bytes_saved += self._keep_embedding(unit)
        if prefix == "":  # the head comes last: the count is complete
            kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
            report.details.append(f"kept as stored: {kinds}" if kinds else "nothing to keep")

    def _fuse(self, parent: nn.Module, name: str, fused: str) -> int:
        """One layer at parent.fused for its parts (FUSED_PARTS) if all are kept and repack
        to one layout; returns the bytes that frees."""
        parts = FUSED_PARTS[fused]
        stored = [self.kept.get(f"{name}.{part}.weight") for part in parts]
        if getattr(parent, fused) is not None or None in stored:
            return 0
        if len({LAYOUTS[self.file.tensors[s].ggml_type] for s in stored}) > 1:
            return 0
        biases = [getattr(parent, part).bias for part in parts]
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
        module = self._module(stored, bias)
        saved = sum(module_bytes(getattr(parent, part)) for part in parts) - module_bytes(module)
        setattr(parent, fused, module)
        for part in parts:
            setattr(parent, part, None)
        return saved

    def _keep_embedding(self, model: nn.Module) -> int:
        """The token table as stored; a head tied to it computes from the same values, in
        its own layer (its kernel's form). Returns the bytes that frees."""
        r = self._repacked(self.kept[EMBEDDING])
        table = model.model.embed_tokens.weight
        model.model.embed_tokens = GroupedEmbedding(
            *(None if a is None else self._tensor(a) for a in vars(r).values()),
            dtype=self.target.dtype,
        )
        kept = [model.model.embed_tokens]
        if model.config.tie_word_embeddings:
            model.lm_head = self._layer(r, None)
            kept.append(model.lm_head)
        return tensor_bytes([table]) - sum(module_bytes(m) for m in kept)

    def _module(self, stored: list[str], bias: torch.Tensor | None) -> nn.Module:
        """The layer of the stored tensors' rows, one after another."""
        return self._layer(_concatenated([self._repacked(name) for name in stored]), bias)

    def _layer(self, r: Repacked, bias: torch.Tensor | None) -> nn.Module:
        if r.mins is None:
            return Int8Linear(self._tensor(r.q), self._tensor(r.scales), bias)
        return Int4Linear(self._tensor(r.q), self._tensor(r.scales), self._tensor(r.mins), bias)

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.target.device)

    def _repacked(self, stored: str) -> Repacked:
        info = self.file.tensors[stored]
        self.types[info.ggml_type.name] += 1
        r = REPACKERS[info.ggml_type](self.file.raw(stored))
        if heads := permuted_heads(self.file.architecture, stored, self.target.config):
            r = Repacked(
                *(None if a is None else unpermute_rows(a, heads) for a in vars(r).values())
            )
        return r


def _concatenated(parts: list[Repacked]) -> Repacked:
    """Repacked tensors of one layout as one, rows after rows."""
    if len(parts) == 1:
        return parts[0]
    mins = None if parts[0].mins is None else np.concatenate([p.mins for p in parts])
    return Repacked(
        np.concatenate([p.q for p in parts]), np.concatenate([p.scales for p in parts]), mins
    )
