"""Tiny random-weight models saved as Hugging Face checkpoints, and helpers to run the core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.pacer import PrefillPacer
from kamado.engine.sampling_params import SamplingParams
from tests.tiny_models import ARCHITECTURES, save_tiny_hf_model


def tiny_hf_model(arch: str, path: Path, **overrides) -> PreTrainedModel:
    """Larger vocabulary and context than the default tiny model, no end-of-sequence token."""
    options = dict(vocab_size=512, max_position_embeddings=1024, eos_token_id=None)
    options["tie_word_embeddings"] = arch == "qwen3"
    return save_tiny_hf_model(path, arch, weight_std=0.08, **{**options, **overrides})


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, PreTrainedModel]]:
    out = {}
    for arch in ARCHITECTURES:
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        out[arch] = (path, tiny_hf_model(arch, path))
    return out


def hf_greedy(
    model,
    prompt: list[int],
    n: int,
    eos: list[int] | None = None,
    logit_bias: dict[int, float] | None = None,
) -> list[int]:
    """transformers' greedy continuation: exactly n tokens, or up to one of `eos`;
    `logit_bias` through its sequence_bias, one-token sequences."""
    options = {"eos_token_id": eos, "pad_token_id": eos[0]} if eos else {"min_new_tokens": n}
    if logit_bias:
        options["sequence_bias"] = [[[t], b] for t, b in logit_bias.items()]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            **({"pad_token_id": 0} | options),
        )
    return out[0, len(prompt) :].tolist()


def make_engine(model: str | Path, **options) -> EngineCore:
    options.setdefault("dtype", "float32")
    options.setdefault("kv_cache_bytes", 8 << 20)
    return EngineCore(EngineConfig(model=str(model), **options))


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Run requests to completion; returns {request_id: {choice index: token ids}}."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    out: dict[str, dict[int, list[int]]] = {}
    while engine.has_work():
        for delta in engine.step():
            out.setdefault(delta.request_id, {}).setdefault(delta.index, []).extend(
                delta.new_token_ids
            )
    return out


def greedy(n: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **extra)


class FixedPacer(PrefillPacer):
    """A fixed schedule whatever the steps take: long prompts (more than `long` new tokens)
    in chunks of `chunk` tokens, `layers` layers a step; follow-ups `short` tokens a step."""

    def __init__(self, chunk: int, layers: int, short: int, long: int) -> None:
        super().__init__(1.25, 512)
        self.chunk, self.layers, self.short = chunk, layers, short
        self.SHORT_TURN_TOKENS = long

    def prefill_limit(self, num_decodes: int) -> int:
        return self.short if num_decodes else self.max_tokens

    def staged_chunk_tokens(self, left: int) -> int:
        return min(self.chunk, left)

    def staged_layers(self, num_tokens: int) -> int:
        return self.layers
