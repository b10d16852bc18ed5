"""Time llguidance token masks for a batch of matchers, the way the engine asks for them.

Each step computes the masks of `batch` matchers (one per sequence), then advances each by
its next token, untimed. Matchers follow the JSON schema of `kamado bench --structured`,
fed either valid JSON (as a real model writes it) or a random allowed token per step (as a
random-weights model picks: argmax of noise over the allowed set).

Ways to compute a step's masks:
  serial     one matcher after another on this thread
  par        llguidance's LLExecutor (rayon threads), `fill_next_token_bitmask_par`
Ways to make the batch's matchers:
  copies     `deep_copy()` of one compiled matcher (what the engine did: the copies share
             one lexer behind one lock)
  own        a matcher compiled per sequence (each has its own lexer)

    PYTHONPATH=$PWD python scripts/mask_speed.py --tokenizer DIR [--batch 1 8] [--threads 2 8]
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kamado.bench.structured import SCHEMA
from kamado.structured import Constraint

WORDS = ["parse", "cache", "token", "buffer", "socket", "index", "retry", "config"]


def valid_json_tokens(hf: Any, seed: int) -> list[int]:
    """A JSON text valid for SCHEMA, tokenized as a model would write it."""
    rng = random.Random(seed)
    records = [
        {
            "file": f"src/{rng.choice(WORDS)}_{rng.choice(WORDS)}.py",
            "line": rng.randint(1, 900),
            "severity": rng.choice(["info", "warning", "error"]),
            "message": " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))),
            "tags": [rng.choice(WORDS) for _ in range(rng.randint(0, 2))],
        }
        for _ in range(60)
    ]
    return hf.encode(json.dumps(records), add_special_tokens=False)


def allowed_ids(bits: torch.Tensor, n_vocab: int) -> np.ndarray:
    unpacked = np.unpackbits(bits.numpy().view(np.uint8), bitorder="little")
    return np.flatnonzero(unpacked[:n_vocab])


def run(
    matchers: list[Any],
    fill: Callable[[list[Any], torch.Tensor], None],
    hf: Any,
    n_vocab: int,
    eos: int,
    steps: int,
    trace: str,
    fresh_buffer: bool,
) -> tuple[list[float], list[float]]:
    """Seconds per step computing the matchers' masks over `steps` steps, and allocating
    the buffer each step (when `fresh_buffer`)."""
    batch = len(matchers)
    scripts = [valid_json_tokens(hf, seed) for seed in range(batch)]
    rng = np.random.default_rng(0)
    words = (n_vocab + 31) // 32
    bits = torch.zeros(batch, words, dtype=torch.int32)
    mask_s: list[float] = []
    alloc_s: list[float] = []
    for step in range(steps):
        if fresh_buffer:  # as the engine allocated: a parallel torch fill at batch >= 7
            started = time.perf_counter()
            bits = torch.zeros(batch, words, dtype=torch.int32)
            alloc_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        fill(matchers, bits)
        mask_s.append(time.perf_counter() - started)
        for i, m in enumerate(matchers):
            if trace == "json":
                token = scripts[i][step]
            else:
                ids = allowed_ids(bits[i], n_vocab)
                ids = ids[ids != eos]
                token = int(rng.choice(ids))
            assert m.consume_token(token), m.get_error()
    return mask_s, alloc_s


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer directory")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--threads", type=int, nargs="+", default=[2, 8])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--traces", nargs="+", default=["json", "random"])
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args()

    import llguidance
    import llguidance.hf
    from llguidance.torch import fill_next_token_bitmask, fill_next_token_bitmask_par
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.tokenizer)
    n_vocab = 151936  # qwen2.5's embedding rows, as the engine passes n_vocab
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab)
    eos = tokenizer.eos_token
    grammar = Constraint.json_schema(SCHEMA).grammar()
    compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0)

    started = time.perf_counter()
    for _ in range(10):
        llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    compile_ms = (time.perf_counter() - started) * 100
    threads = torch.get_num_threads()
    print(f"compiling the grammar: {compile_ms:.2f} ms a matcher; torch threads {threads}")

    makers = {
        "copies": compiled.deep_copy,
        "own": lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0),
    }

    def serial(matchers: list[Any], bits: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            fill_next_token_bitmask(m, bits, i)

    def par(executor: Any) -> Callable[[list[Any], torch.Tensor], None]:
        def fill(matchers: list[Any], bits: torch.Tensor) -> None:
            fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)], bits)

        return fill

    fills = {"serial": serial}
    for n in args.threads:
        fills[f"par{n}"] = par(llguidance.LLExecutor(n))

    rows = []
    for trace, batch, how, made in itertools.product(args.traces, args.batch, fills, makers):
        for fresh in (False, True) if batch > 1 else (False,):
            mask_s, alloc_s = [], []
            for _ in range(args.repeats):
                matchers = [makers[made]() for _ in range(batch)]
                m, a = run(matchers, fills[how], hf, n_vocab, eos, args.steps, trace, fresh)
                mask_s += m
                alloc_s += a
            row = {
                "trace": trace,
                "batch": batch,
                "compute": how,
                "matchers": made,
                "fresh_torch_buffer": fresh,
                "mask_ms_median": 1e3 * statistics.median(mask_s),
                "mask_ms_mean": 1e3 * statistics.mean(mask_s),
                "alloc_ms_median": 1e3 * statistics.median(alloc_s) if alloc_s else 0.0,
            }
            rows.append(row)
            print(
                f"{trace:6s} batch {batch:2d} {how:6s} {made:6s} "
                f"{'zeros/step' if fresh else 'reused buf'}: masks median "
                f"{row['mask_ms_median']:.3f} ms, mean {row['mask_ms_mean']:.3f} ms a step; "
                f"torch.zeros median {row['alloc_ms_median']:.3f} ms",
                flush=True,
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"compile_ms": compile_ms, "torch_threads": threads, "rows": rows}, f)


if __name__ == "__main__":
    main()
