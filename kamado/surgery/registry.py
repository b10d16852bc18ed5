"""Surgery step names -> steps, checked and put in stage order."""

from __future__ import annotations

from kamado.config import EngineConfig
from kamado.surgery.fuse import FuseStep
from kamado.surgery.gguf import GGUFStep
from kamado.surgery.names import parse_surgery
from kamado.surgery.pipeline import LoadTarget, SurgeryStep
from kamado.surgery.quantize_steps import Fp8Step, Int4Step, Int8Step

WEIGHT_STEPS: dict[str, type] = {
    "gguf": GGUFStep,
    "fuse": FuseStep,
    "int8": Int8Step,
    "int4": Int4Step,
    "fp8": Fp8Step,
}


def weight_step_names(config: EngineConfig) -> list[str]:
    """The weight steps config asks for; on CUDA with fused kernels, fusion is implied."""
    names = [n for n in parse_surgery(",".join(config.surgery)) if n in WEIGHT_STEPS]
    if config.fused_kernels and config.device.startswith("cuda") and "fuse" not in names:
        names.append("fuse")
    return names


def make_steps(names: list[str], target: LoadTarget) -> list[SurgeryStep]:
    steps = [WEIGHT_STEPS[name](target) for name in names]
    return sorted(steps, key=lambda s: s.stage)
