"""Tiny random-weight models saved as Hugging Face checkpoints, and helpers to run the core."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams

ARCHITECTURES = ["llama", "mistral", "qwen2", "qwen3"]


def tiny_hf_model(arch: str, path: Path, **overrides) -> AutoModelForCausalLM:
    """A 2-layer random model of `arch`, saved to `path`; returns the transformers model."""
    options = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=arch == "qwen3",
        eos_token_id=None,
    )
    if arch == "qwen3":
        options["head_dim"] = 32
    options.update(overrides)
    config = AutoConfig.for_model(arch, **options)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # larger-than-default weights give peaked, non-degenerate outputs
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, tuple[Path, AutoModelForCausalLM]]:
    out = {}
    for arch in ARCHITECTURES:
        path = tmp_path_factory.mktemp(f"tiny-{arch}")
        out[arch] = (path, tiny_hf_model(arch, path))
    return out


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
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
