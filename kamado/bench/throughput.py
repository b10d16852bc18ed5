"""Offline prefill and decode throughput: kamado beside transformers `generate`."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_model_config, load_weights, resolve_model
from kamado.models.reference import transformers_model


@dataclass
class Throughput:
    engine: str
    model: str
    batch: int
    prompt_len: int
    gen_len: int
    prefill_tok_s: float
    decode_tok_s: float
    runs: int = 1  # rates are the median of this many runs


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Stay clear of the special tokens at the top of the vocabulary.
    return [[rng.randrange(100, min(vocab, 30000)) for _ in range(length)] for _ in range(batch)]


def kamado_throughput(
    engine: EngineCore, model: str, batch: int, prompt_len: int, gen_len: int
) -> Throughput:
    """Prefill: all prompts until each has its first token. Decode: the steps in which the
    whole batch decodes, from then until the first request finishes. (Prompts longer than
    a step's token budget are prefilled one after another, and the first ones decode
    meanwhile; over the whole tail, the batch would shrink as they finish.) An error where
    no step decodes the whole batch: the first finished before the last had its first
    token."""
    prompts = random_prompts(batch, prompt_len, engine.model_config.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{batch}-{i}", prompt, params)
    have_first: set[str] = set()
    prefilled_at = whole_until = None
    finished_early = False  # one finished before the last had its first token
    decoded = 0  # tokens of the steps in which the whole batch decoded
    while engine.has_work():
        deltas = engine.step()
        now = time.perf_counter()
        finished = any(d.finished for d in deltas)
        if prefilled_at is None:
            have_first.update(d.request_id for d in deltas)
            finished_early |= finished
            if len(have_first) == batch:
                prefilled_at = now
        elif whole_until is None:
            decoded += sum(len(d.new_token_ids) for d in deltas)
            if finished:
                whole_until = now
    if finished_early or prefilled_at is None or whole_until is None or decoded == 0:
        raise ValueError(
            f"no step decoded all {batch} sequences of {prompt_len} tokens together within "
            f"{gen_len} new tokens: raise the number of new tokens (or, where the engine "
            "paces prompts beside decodes, prefill them unpaced)"
        )
    return Throughput(
        "kamado",
        model,
        batch,
        prompt_len,
        gen_len,
        batch * prompt_len / (prefilled_at - started),
        decoded / (whole_until - prefilled_at),
    )


class _FirstTokenClock:
    """A `generate` streamer noting when the first new tokens arrive (the end of prefill):
    one call then times prefill and decode apart."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value: torch.Tensor) -> None:  # the prompt first, then each new token
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def transformers_throughput(
    reference: torch.nn.Module,
    model: str,
    batch: int,
    prompt_len: int,
    gen_len: int,
    vocab: int,
    device: str = "cpu",
) -> Throughput:
    ids = torch.tensor(random_prompts(batch, prompt_len, vocab), device=device)
    clock = _FirstTokenClock()
    started = time.perf_counter()
    with torch.inference_mode():
        reference.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=gen_len,
            min_new_tokens=gen_len,
            do_sample=False,
            pad_token_id=0,
            streamer=clock,
        )
    done = time.perf_counter()
    prefilled_at = clock.puts[1]
    return Throughput(
        "transformers",
        model,
        batch,
        prompt_len,
        gen_len,
        batch * prompt_len / (prefilled_at - started),
        batch * (gen_len - 1) / (done - prefilled_at),
    )


def load_reference(model: str, dtype: torch.dtype) -> torch.nn.Module:
    """Plain transformers (eager decode loop, SDPA attention) holding the same weights in
    the same dtype: the side-by-side peer."""
    source = resolve_model(model)
    config = load_model_config(source)
    weights = load_weights(source, config, dtype)
    return transformers_model(config, weights, attn_implementation="sdpa").eval()


def run_throughput(
    models: list[str],
    dtype: str,
    prompt_len: int,
    gen_len: int,
    batches: tuple[int, ...] = (1, 8),
    peer: bool = True,
    repeats: int = 1,
) -> list[dict]:
    """Each batch `repeats` times, kamado and transformers alternating, so that the
    machine's drift falls on both; a row per engine and batch, each rate the median of
    its runs."""
    rows: list[Throughput] = []
    for model in models:
        # Batches repeat prompts: without the cache off, later ones would be served from it.
        # Speculation off: one token a step, as transformers' generate decodes; on random
        # prompts greedy output repeats itself, so drafts would run far ahead (a batch-1
        # rate of 5x transformers'). `kamado bench --spec` measures it on real tasks.
        config = EngineConfig(
            model=model, dtype=dtype, enable_prefix_caching=False, speculation="off"
        )
        engine = EngineCore(config)
        vocab = engine.model_config.vocab_size
        kamado_throughput(engine, model, 1, 16, 4)  # warm-up
        reference = load_reference(model, engine.dtype) if peer else None
        if reference is not None:
            transformers_throughput(reference, model, 1, 16, 4, vocab)  # warm-up
        for batch in batches:
            runs: dict[str, list[Throughput]] = {"kamado": [], "transformers": []}
            for _ in range(repeats):
                runs["kamado"].append(kamado_throughput(engine, model, batch, prompt_len, gen_len))
                if reference is not None:
                    runs["transformers"].append(
                        transformers_throughput(reference, model, batch, prompt_len, gen_len, vocab)
                    )
            for engine_runs in runs.values():
                if engine_runs:
                    rows.append(_median(engine_runs))
                    print(_fmt(rows[-1]), flush=True)
        del engine, reference
    _summary(rows)
    return [asdict(r) for r in rows]


def _median(runs: list[Throughput]) -> Throughput:
    """One engine's runs of one batch as one row: each rate the median of its runs."""
    return replace(
        runs[0],
        runs=len(runs),
        prefill_tok_s=statistics.median(r.prefill_tok_s for r in runs),
        decode_tok_s=statistics.median(r.decode_tok_s for r in runs),
    )


def _fmt(r: Throughput) -> str:
    return (
        f"{r.model:32s} {r.engine:12s} batch {r.batch:2d}: "
        f"prefill {r.prefill_tok_s:8.1f} tok/s   decode {r.decode_tok_s:7.1f} tok/s"
    )


def _summary(rows: list[Throughput]) -> None:
    print("\nside by side (kamado / transformers):")
    for r in rows:
        if r.engine != "kamado":
            continue
        peer = next(
            (p for p in rows if p.engine != "kamado" and (p.model, p.batch) == (r.model, r.batch)),
            None,
        )
        single = next(p for p in rows if p.engine == "kamado" and p.model == r.model)
        line = f"  {r.model} batch {r.batch}: decode {r.decode_tok_s:.1f} tok/s"
        if peer:
            line += (
                f" = {r.decode_tok_s / peer.decode_tok_s:.2f}x transformers; prefill "
                f"{r.prefill_tok_s / peer.prefill_tok_s:.2f}x"
            )
        if r.batch > 1:
            line += f"; {r.decode_tok_s / single.decode_tok_s:.2f}x kamado batch {single.batch}"
        print(line)
