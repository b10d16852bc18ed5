"""`kamado bench --kv-cache`: a quantized KV cache (int8, fp8) beside the model-dtype cache
in one run: tokens of context that fit the same byte budget, decode tokens/s over a long
context (repeats interleaved, medians), and agreement with the model-dtype cache's greedy
tokens (up to the first difference, and teacher-forced top-1).

On CUDA each row also carries its decode roofline: the copy bandwidth measured in the same
run over the bytes one step reads (every weight once, plus each sequence's K/V and scales).
"""

from __future__ import annotations

import math
import statistics
import time

from kamado.bench.gpu import copy_bandwidth, decode_bytes
from kamado.bench.throughput import kamado_throughput, random_prompts
from kamado.config import KV_CACHE_DTYPES, EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.kv.cache import bytes_per_block
from kamado.models import resolve_model
from kamado.models.tokenizer import load_tokenizer

# The fixed prompt set for greedy agreement: code and prose, as agents send.
AGREEMENT_PROMPTS = [
    "def fibonacci(n):",
    "# A Python function that parses a CSV file and returns a list of dicts\n",
    "The capital of France is",
    "import json\n\ndata = {'a': 1, 'b': [1, 2, 3]}\n",
    "class Stack:\n    def __init__(self):\n",
    "SELECT name, COUNT(*) FROM users",
    "// Reverse a linked list in C\nstruct Node {",
    "Write a haiku about the sea:\n",
    "fn main() {\n    let v = vec![3, 1, 2];\n",
    "The three laws of thermodynamics are",
    "#!/bin/bash\n# Back up a directory to a tarball with today's date\n",
    "function debounce(fn, ms) {",
    "Q: What is 17 times 23?\nA:",
    "<html>\n<head>\n<title>",
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "In 1969, the Apollo 11 mission",
]
AGREEMENT_TOKENS = 32


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, int]:
    """Share of the reference's tokens matched up to each continuation's first difference
    (after it the two continue from different text), and how many match whole."""
    matched = total = identical = 0
    for a, b in zip(ours, reference, strict=True):
        same = [x == y for x, y in zip(a, b, strict=False)]
        matched += same.index(False) if False in same else len(same)
        total += len(b)
        identical += a == b
    return matched / total, identical


def greedy_continuations(engine: EngineCore, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n)  # stops at end-of-sequence
    for i, prompt in enumerate(prompts):
        engine.add_request(f"agree-{i}", prompt, params)
    out: dict[str, list[int]] = {f"agree-{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for delta in engine.step():
            out[delta.request_id].extend(delta.new_token_ids)
    return list(out.values())


def top1_agreement(
    engine: EngineCore, prompts: list[list[int]], reference: list[list[int]]
) -> float:
    """Teacher-forced: the share of reference tokens that are the engine's greedy pick after
    the prompt and the reference's tokens before them. Unlike greedy agreement, one early
    near-tie does not decide a whole continuation."""
    forced = [p + r[:t] for p, r in zip(prompts, reference, strict=True) for t in range(len(r))]
    picks = greedy_continuations(engine, forced, 1)
    expected = [token for r in reference for token in r]
    return sum(p[:1] == [e] for p, e in zip(picks, expected, strict=True)) / len(expected)


def agreement_prompts(model: str, vocab_size: int) -> list[list[int]]:
    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:  # synthetic weights: random token ids
        return random_prompts(len(AGREEMENT_PROMPTS), 16, vocab_size, seed=1)
    return [tokenizer.encode(p) for p in AGREEMENT_PROMPTS]


def run_kv_cache_bench(
    model: str,
    device: str,
    dtype: str = "auto",
    budget_bytes: int = 1 << 30,
    batch: int = 4,
    prompt_len: int = 2048,
    gen_len: int = 32,
    repeats: int = 3,
    formats: tuple[str, ...] = KV_CACHE_DTYPES,  # "auto" first: the reference
) -> dict:
    # No prefix cache: each repeat's new prompts would otherwise push the last one's blocks
    # to the host tier while decoding is timed (an H200 run spread 38-815 tok/s that way).
    # Prompts unpaced: paced beside the first one's decodes, 16k-token prompts went a few
    # layers a step and each sequence finished before the next began (an H200 run timed
    # one sequence's decodes as the batch's).
    engines = {
        kv: EngineCore(
            EngineConfig(
                model=model, device=device, dtype=dtype, kv_cache_dtype=kv,
                kv_cache_bytes=budget_bytes, max_num_seqs=max(batch, len(AGREEMENT_PROMPTS)),
                enable_prefix_caching=False, speculation="off",  # one token a step
                decode_stall_factor=math.inf,
            )
        )
        for kv in formats
    }  # fmt: skip
    auto = engines["auto"]
    needed, held = batch * (prompt_len + gen_len), auto.num_blocks * auto.config.block_size
    if needed > held:  # decoding would preempt and recompute, and time that instead
        raise ValueError(
            f"the {auto.dtype} cache holds {held} tokens in this budget; a batch of {batch} "
            f"x {prompt_len + gen_len} needs {needed}: raise --kv-cache-gb"
        )
    bandwidth = copy_bandwidth() if device.startswith("cuda") else None
    rates: dict[str, list[float]] = {kv: [] for kv in formats}
    for engine in engines.values():
        kamado_throughput(engine, model, 1, 16, 4)  # warm-up
    for _ in range(repeats):  # interleaved, so a noisy machine weighs on all alike
        for kv, engine in engines.items():
            r = kamado_throughput(engine, model, batch, prompt_len, gen_len)
            rates[kv].append(r.decode_tok_s)
    prompts = agreement_prompts(model, auto.model_config.vocab_size)
    reference = greedy_continuations(auto, prompts, AGREEMENT_TOKENS)
    rows = []
    for kv, engine in engines.items():
        config = engine.model_config
        block_bytes = bytes_per_block(
            config, engine.config.block_size, engine.dtype, engine.kv_format
        )
        row = dict(
            kv_cache_dtype=kv,
            stored_as=engine.kv_format.name,
            bytes_per_token=block_bytes // engine.config.block_size,
            context_tokens=engine.num_blocks * engine.config.block_size,
            decode_tok_s=statistics.median(rates[kv]),
            decode_tok_s_runs=rates[kv],
        )
        if bandwidth is not None:
            context = prompt_len + gen_len // 2
            step = decode_bytes(engine.runner.model, config, batch, context, row["bytes_per_token"])
            row["roofline_tok_s"] = batch * bandwidth / step
        if kv != "auto":
            ours = greedy_continuations(engine, prompts, AGREEMENT_TOKENS)
            row["agreement"], row["identical"] = agreement(ours, reference)
            row["top1_agreement"] = top1_agreement(engine, prompts, reference)
        rows.append(row)
    base = rows[0]
    for row in rows:
        row["context_ratio"] = row["context_tokens"] / base["context_tokens"]
        row["decode_ratio"] = row["decode_tok_s"] / base["decode_tok_s"]
        print(_fmt(row, len(prompts)), flush=True)
    return dict(
        model=model, device=device, dtype=str(auto.dtype), budget_bytes=budget_bytes,
        batch=batch, prompt_len=prompt_len, gen_len=gen_len, repeats=repeats,
        agreement_prompts=len(prompts), agreement_tokens=AGREEMENT_TOKENS,
        copy_bandwidth_tb_s=None if bandwidth is None else bandwidth / 1e12,
        rows=rows, date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )  # fmt: skip


def _fmt(row: dict, num_prompts: int) -> str:
    line = (
        f"kv {row['kv_cache_dtype']:4s} ({row['stored_as']}): {row['bytes_per_token']:7d} B/token, "
        f"{row['context_tokens']:8d} tokens of context ({row['context_ratio']:.2f}x), "
        f"decode {row['decode_tok_s']:8.1f} tok/s ({row['decode_ratio']:.2f}x)"
    )
    if "roofline_tok_s" in row:
        line += f", roofline {row['roofline_tok_s']:8.1f}"
    if "agreement" in row:
        line += (
            f"; greedy agreement {row['agreement']:.1%} ({row['identical']}/{num_prompts} "
            f"identical), top-1 {row['top1_agreement']:.2%}"
        )
    return line
