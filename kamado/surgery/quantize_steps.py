"""Steps `int8`, `int4` and `fp8`: every projection of every layer, and an untied output
head, compressed to one format; the model's other tensors stay as loaded.

The embedding table stays full precision: a lookup reads only the batch's rows, so
compressing it saves memory but no bandwidth. A head tied to the embedding stays too:
compressing it would add a second copy, not save one.
"""

from __future__ import annotations

import torch
from torch import nn

from kamado.surgery import formats
from kamado.surgery.pipeline import LoadTarget, StepReport, linear_slots, replace_linear
from kamado.surgery.qlinear import Fp8Linear, Int4Linear, Int8Linear

INT4_GROUPS = (128, 64, 32)  # the largest that divides a layer's input size is used


class _CompressStep:
    name = ""
    stage = 2
    skip_loading: frozenset[str] = frozenset()

    def __init__(self, target: LoadTarget) -> None:
        self.target = target

    def apply(self, unit: nn.Module, prefix: str, report: StepReport) -> None:
        for parent, attr, _ in linear_slots(unit, prefix):
            linear = getattr(parent, attr)
            if type(linear) is nn.Linear:
                report.bytes_saved += replace_linear(parent, attr, self.compress(linear))
                if attr == "lm_head":
                    report.details.append("output head included")

    def compress(self, linear: nn.Linear) -> nn.Module:
        raise NotImplementedError


class Int8Step(_CompressStep):
    """int8 values, one float32 scale per output channel."""

    name = "int8"

    def compress(self, linear: nn.Linear) -> nn.Module:
        q, scales = formats.quantize_int8(linear.weight)
        return Int8Linear(q, scales, linear.bias)


class Int4Step(_CompressStep):
    """4-bit values with a float16 scale and min per group of up to 128 inputs."""

    name = "int4"

    def compress(self, linear: nn.Linear) -> nn.Module:
        group = next((g for g in INT4_GROUPS if linear.in_features % g == 0), None)
        if group is None:
            raise ValueError(f"int4: input size {linear.in_features} is not a multiple of 32")
        q, scales, mins = formats.quantize_int4(linear.weight, group)
        return Int4Linear(q, scales, mins, linear.bias)


class Fp8Step(_CompressStep):
    """float8 e4m3 values, one float32 scale per output channel; CUDA with fp8 support."""

    name = "fp8"

    def __init__(self, target: LoadTarget) -> None:
        super().__init__(target)
        device = torch.device(target.device)
        if device.type != "cuda" or torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(
                "surgery fp8 needs an NVIDIA GPU with fp8 support (compute capability 8.9+: "
                f"Ada, Hopper); this device is {target.device}. Use int8 or int4 instead."
            )

    def compress(self, linear: nn.Linear) -> nn.Module:
        q, scales = formats.quantize_fp8(linear.weight)
        return Fp8Linear(q, scales, linear.bias)
