"""Surgery step names -> steps, checked and put in stage order."""

from __future__ import annotations

from collections.abc import Callable

from kamado.config import EngineConfig
from kamado.surgery.fuse import FuseStep
from kamado.surgery.names import parse_surgery
from kamado.surgery.pipeline import LoadTarget, SurgeryStep
from kamado.surgery.quantize_steps import Fp8Step, Int4Step, Int8Step


def _gguf_step(target: LoadTarget) -> SurgeryStep:
    from kamado.surgery.gguf import GGUFStep  # needs the gguf package, which GPU hosts lack

    return GGUFStep(target)


WEIGHT_STEPS: dict[str, Callable[[LoadTarget], SurgeryStep]] = {
    "gguf": _gguf_step,
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
