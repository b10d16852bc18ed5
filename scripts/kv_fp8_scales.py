"""How fine must an fp8 KV cache's scales be? Against the model-dtype cache, over the fixed
prompts of `kamado bench --kv-cache` and the cache's own greedy continuations of them
(teacher-forced): mean KL divergence of the next-token distributions, top-1 agreement, and
greedy agreement (each continuation up to its first differing token), for

- fp8: a float32 scale per token and kv head (the vector's largest value is stored exactly);
- fp8, power-of-two scales per token and kv head: a one-byte scale, which rounds that value;
- fp8-static: one calibrated scale per layer and kv head (kv/calibration.py).

Also how far the prompts' K/V go past the calibration text's (the headroom they use).

    .venv/bin/python scripts/kv_fp8_scales.py [--model smollm2-135m] [--dtype float32]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kamado.bench.kv_cache import (
    AGREEMENT_TOKENS,
    agreement,
    agreement_prompts,
    greedy_continuations,
)
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.kv import cache as kv_cache
from kamado.kv.calibration import calibration_ids
from kamado.kv.quant import FP8_MAX
from kamado.models import resolve_model
from kamado.surgery.check import teacher_forced_logits


def engine(model: str, dtype: str, kv: str) -> EngineCore:
    config = EngineConfig(
        model=model, device="cpu", dtype=dtype, kv_cache_dtype=kv, kv_cache_bytes=64 << 20,
        enable_prefix_caching=False, speculation="off",
    )  # fmt: skip
    return EngineCore(config)


def kv_amax(eng: EngineCore, ids: list[int]) -> torch.Tensor:
    """[2, layers, kv_heads]: the largest |K| and |V| over one prefill of ids."""
    tops: dict[tuple[int, int], torch.Tensor] = {}
    store = kv_cache.KVCache.store

    def recording(self, layer, slots, k, v):  # noqa: ANN001, ANN202
        for i, x in enumerate((k, v)):
            tops[i, layer] = x.float().abs().amax(dim=(0, 2))
        store(self, layer, slots, k, v)

    kv_cache.KVCache.store = recording
    try:
        teacher_forced_logits(eng, ids)
    finally:
        kv_cache.KVCache.store = store
    layers = eng.model_config.num_layers
    return torch.stack([torch.stack([tops[i, n] for n in range(layers)]) for i in (0, 1)])


def power_of_two_scales_per_token() -> Callable[[], None]:
    """Patch the torch cache's fp8 scales to powers of two (as a one-byte exponent would
    store them); returns the undo."""
    quantize = kv_cache.quantize

    def pow2(x, fmt, scale=None):  # noqa: ANN001, ANN202
        amax = x.float().abs().amax(dim=-1)
        scale = torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / FP8_MAX)))
        return quantize(x, fmt, scale)

    kv_cache.quantize = pow2

    def undo() -> None:
        kv_cache.quantize = quantize

    return undo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    reference = engine(args.model, args.dtype, "auto")
    prompts = agreement_prompts(args.model, reference.model_config.vocab_size)
    continuations = greedy_continuations(reference, prompts, AGREEMENT_TOKENS)
    sequences = [p + c for p, c in zip(prompts, continuations, strict=True)]
    ref_logp = [F.log_softmax(teacher_forced_logits(reference, s), -1) for s in sequences]

    calibration = calibration_ids(resolve_model(args.model), reference.model_config.vocab_size)
    seen = kv_amax(reference, [t for p in prompts for t in p])
    ratio = seen / kv_amax(reference, calibration)
    print(
        f"{args.model}, {args.dtype}, {len(prompts)} prompts x {AGREEMENT_TOKENS} tokens; "
        f"calibration {len(calibration)} tokens. The prompts' largest |K|, |V| over the "
        f"calibration's: at most {ratio.max():.2f}x (median {ratio.median():.2f}x) over "
        f"{ratio.numel()} (K or V, layer, kv head)"
    )
    variants: list[tuple[str, str, Callable[[], Callable[[], None]] | None]] = [
        ("fp8, float32 scale per token", "fp8", None),
        ("fp8, power-of-two scale per token", "fp8", power_of_two_scales_per_token),
        ("fp8-static, calibrated per layer", "fp8-static", None),
    ]
    for label, kv, patch in variants:
        undo = patch() if patch is not None else None
        try:
            eng = engine(args.model, args.dtype, kv)
            kl, top1 = [], []
            for s, lp in zip(sequences, ref_logp, strict=True):
                ours = F.log_softmax(teacher_forced_logits(eng, s), -1)
                kl.append((lp.exp() * (lp - ours)).sum(-1))
                top1.append(ours.argmax(-1) == lp.argmax(-1))
            share, same = agreement(greedy_continuations(eng, prompts, AGREEMENT_TOKENS),
                                    continuations)  # fmt: skip
        finally:
            if undo is not None:
                undo()
        print(
            f"{label:36s} mean KL {torch.cat(kl).mean():.5f}  "
            f"top-1 {torch.cat(top1).float().mean():.2%}  greedy {share:.1%} "
            f"({same}/{len(prompts)} identical)",
            flush=True,
        )


if __name__ == "__main__":
    main()
