"""Constrained vs unconstrained decoding on the same prompts, and where the mask time goes.

Both runs decode exactly `gen_len` tokens per sequence at the same batch size: the
unconstrained run ignores EOS, and the constrained one follows a JSON schema (an array of
at least 50 records) that cannot complete sooner, so neither batch shrinks early and the
tokens/s compare like for like.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_tokenizer, resolve_model
from kamado.structured import Constraint
from kamado.structured.guide import Guides, GuideStats

RECORD = {
    "type": "object",
    "properties": {
        "file": {"type": "string"},
        "line": {"type": "integer", "minimum": 1},
        "severity": {"enum": ["info", "warning", "error"]},
        "message": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["file", "line", "severity", "message"],
    "additionalProperties": False,
}
SCHEMA = {"type": "array", "items": RECORD, "minItems": 50}
TOPICS = ["a web server", "a CSV parser", "a tokenizer", "a cache", "a scheduler", "a CLI"]


@dataclass
class StructuredRun:
    constrained: bool
    batch: int
    gen_len: int
    decode_tok_s: float
    step_ms: float
    # Per decoded token, in ms (constrained runs only).
    mask_prepare_ms: float = 0.0  # engine thread handing the matchers to the worker
    mask_compute_ms: float = 0.0  # on the worker thread, overlapped with the forward pass
    mask_wait_ms: float = 0.0  # engine blocked waiting for masks
    mask_apply_ms: float = 0.0
    matcher_advance_ms: float = 0.0


def _prompts(tokenizer: Any, batch: int) -> list[list[int]]:
    out = []
    for i in range(batch):
        ask = f"List lint findings for {TOPICS[i % len(TOPICS)]} (#{i}) as a JSON array."
        messages = [{"role": "user", "content": ask}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        out.append(tokenizer.encode(text))
    return out


def _run(
    engine: EngineCore, prompts: list[list[int]], gen_len: int, constrained: bool, tag: str
) -> StructuredRun:
    constraint = Constraint.json_schema(SCHEMA) if constrained else None
    params = SamplingParams(
        temperature=0.0, max_tokens=gen_len, ignore_eos=not constrained, constraint=constraint
    )
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", prompt, params)
    # Prefill everything first (on a CPU the prompts may take several steps, some decoding
    # meanwhile), so the timed part is decode steps at a fixed batch size.
    started = None
    steps = tokens = total = 0
    first_tokens: set[str] = set()
    while engine.has_work():
        deltas = engine.step()
        total += sum(len(d.new_token_ids) for d in deltas)
        if started is None:
            first_tokens |= {d.request_id for d in deltas if d.new_token_ids}
            if len(first_tokens) < len(prompts):
                continue
            before = GuideStats(**vars(engine.guides.stats))
            started = time.perf_counter()
            continue
        steps += 1
        tokens += sum(len(d.new_token_ids) for d in deltas)
    seconds = time.perf_counter() - started
    assert started is not None and total == len(prompts) * gen_len, "a sequence ended early"
    after = engine.guides.stats
    per_token_ms = 1000.0 / tokens
    return StructuredRun(
        constrained,
        len(prompts),
        gen_len,
        tokens / seconds,
        1000.0 * seconds / steps,
        (after.prepare_s - before.prepare_s) * per_token_ms,
        (after.compute_s - before.compute_s) * per_token_ms,
        (after.wait_s - before.wait_s) * per_token_ms,
        (after.apply_s - before.apply_s) * per_token_ms,
        (after.advance_s - before.advance_s) * per_token_ms,
    )


def run_structured(
    model: str,
    dtype: str,
    gen_len: int,
    tokenizer_dir: str | None = None,
    batches: tuple[int, ...] = (1, 8),
    repeats: int = 2,
) -> list[dict]:
    """`tokenizer_dir` gives a synthetic model (random weights at a real shape, for GPUs
    without the model file) a real model's tokenizer: masks cost the same for any weights."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # Constrained requests are never speculated on; the free run must not be either.
    engine = EngineCore(EngineConfig(model=model, dtype=dtype, device=device, speculation="off"))
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        config = engine.model_config
        engine.guides = Guides(
            model, config.vocab_size, config.eos_token_ids, engine.runner.device, tokenizer
        )
    else:
        tokenizer = load_tokenizer(resolve_model(model))
        assert tokenizer is not None, "a synthetic model needs --tokenizer"
    rows: list[StructuredRun] = []
    _run(engine, _prompts(tokenizer, 1), 8, True, "warm-up")  # builds the llguidance tokenizer
    for batch in batches:
        prompts = _prompts(tokenizer, batch)
        # Alternate the two kinds, so drift in a shared machine's load hits both alike.
        for r in range(repeats):
            for constrained in (False, True):
                tag = f"b{batch}-r{r}-{'c' if constrained else 'u'}"
                rows.append(_run(engine, prompts, gen_len, constrained, tag))
                print(_fmt(rows[-1]), flush=True)
    _summary(rows)
    return [asdict(r) for r in rows]


def _fmt(r: StructuredRun) -> str:
    line = (
        f"batch {r.batch:2d} {'constrained  ' if r.constrained else 'unconstrained'}: "
        f"decode {r.decode_tok_s:7.1f} tok/s, step {r.step_ms:6.1f} ms"
    )
    if r.constrained:
        line += (
            f"; per token: prepare {r.mask_prepare_ms:.3f}, mask {r.mask_compute_ms:.3f} ms "
            f"(overlapped), wait "
            f"{r.mask_wait_ms:.3f}, apply {r.mask_apply_ms:.3f}, advance "
            f"{r.matcher_advance_ms:.3f} ms"
        )
    return line


def _summary(rows: list[StructuredRun]) -> None:
    print("\nconstrained / unconstrained decode tok/s (best of the repeats):")
    for batch in sorted({r.batch for r in rows}):
        best = {
            c: max(r.decode_tok_s for r in rows if r.batch == batch and r.constrained == c)
            for c in (False, True)
        }
        print(f"  batch {batch}: {best[True] / best[False]:.3f}")
