"""Step `gguf`: serve a GGUF file's quantized projections as stored.

Without it the loader dequantizes every tensor to the serving dtype. With it, projections
stored as Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q4_K are never read by the loader: this step repacks
their blocks into int8 / int4 layers (gguf_repack.py), exactly, with no float copy of the
weight ever made. Tensors of other types (F16, F32, Q6_K, ...) load as before.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from torch import nn

from kamado.models.gguf_loader import gguf_name, permuted_heads, unpermute_rows
from kamado.models.gguf_reader import GGUFFile
from kamado.models.layout import expected_weights
from kamado.surgery.gguf_repack import REPACKERS, Repacked
from kamado.surgery.pipeline import LoadTarget, StepReport, linear_slots, replace_linear
from kamado.surgery.qlinear import Int4Linear, Int8Linear


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
            if name.endswith("proj.weight") or name == "lm_head.weight":
                stored = gguf_name(name)
                if self.file.tensors[stored].ggml_type in REPACKERS:
                    self.kept[name] = stored
        self.skip_loading = frozenset(self.kept)
        self.types: Counter[str] = Counter()

    def apply(self, unit: nn.Module, prefix: str, report: StepReport) -> None:
        for parent, attr, name in linear_slots(unit, prefix):
            stored = self.kept.get(f"{name}.weight")
            if stored is not None:
                module = self._module(stored, getattr(parent, attr).bias)
                report.bytes_saved += replace_linear(parent, attr, module)
        if prefix == "":  # the head comes last: the count is complete
            kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items()))
            report.details.append(f"kept as stored: {kinds}" if kinds else "nothing to keep")

    def _module(self, stored: str, bias: torch.Tensor | None) -> nn.Module:
        info = self.file.tensors[stored]
        self.types[info.ggml_type.name] += 1
        r = REPACKERS[info.ggml_type](self.file.raw(stored))
        if heads := permuted_heads(self.file.architecture, stored, self.target.config):
            r = Repacked(
                *(None if a is None else unpermute_rows(a, heads) for a in vars(r).values())
            )
        device = self.target.device

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        if r.mins is None:
            return Int8Linear(tensor(r.q), tensor(r.scales), bias)
        return Int4Linear(tensor(r.q), tensor(r.scales), tensor(r.mins), bias)
