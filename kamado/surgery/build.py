"""Build the Transformer from a stream of weights, applying surgery layer by layer.

Each decoder layer is transformed as soon as its weights have arrived, so the peak memory
is the transformed model plus one layer as loaded: a model that does not fit in bf16 can
still be loaded into a GPU that holds its compressed form.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch

from kamado.config import ModelConfig
from kamado.models.transformer import Transformer
from kamado.surgery.pipeline import StepReport, SurgeryStep

log = logging.getLogger(__name__)

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@torch.no_grad()  # loaded parameters require grad: without this, steps would keep autograd graphs
def build_model(
    config: ModelConfig,
    weights: Iterable[tuple[str, torch.Tensor]],
    steps: list[SurgeryStep],
    dtype: torch.dtype,
) -> tuple[Transformer, list[StepReport]]:
    """The model, in eval mode, and one report per step (also logged)."""
    with torch.device("meta"):  # in dtype: a weight a step builds itself counts at its size
        model = Transformer(config).to(dtype)
    model.eval()
    reports = [StepReport(step.name) for step in steps]
    pending: dict[str, torch.Tensor] = {}
    pending_layer: int | None = None

    def finish_layer() -> None:
        model.load_state_dict(pending, strict=False, assign=True)
        pending.clear()
        if pending_layer is not None:
            prefix = f"model.layers.{pending_layer}."
            _apply(steps, reports, model.model.layers[pending_layer], prefix)

    for name, tensor in weights:
        m = _LAYER.match(name)
        layer = int(m[1]) if m else None
        if layer != pending_layer and pending:
            finish_layer()
        pending_layer = layer
        pending[name] = tensor
    finish_layer()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    _apply(steps, reports, model, "")
    unloaded = [n for n, p in model.state_dict().items() if p.device.type == "meta"]
    if unloaded:
        raise ValueError(f"weights never loaded: {', '.join(unloaded[:5])}")
    for report in reports:
        log.info(report.line())
    return model, reports


def _apply(
    steps: list[SurgeryStep], reports: list[StepReport], unit: torch.nn.Module, prefix: str
) -> None:
    for step, report in zip(steps, reports, strict=True):
        step.apply(unit, prefix, report)
