"""Where do the slow steps beside a long prompt go? (CUDA)

Three streams decode while a long prompt goes a few layers a step, as in
`kamado bench --fairness`. For every step it records the step's time, the chunk it ran,
and what happened on the host besides the model: device allocations the caching allocator
had to make (cudaMalloc), and Triton kernels compiled. It prints the slowest steps.

    python scripts/staged_step_probe.py [--prompt-len 131000] [--seconds 60]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams


def triton_kernels() -> list:
    """Every Triton kernel loaded so far (the engine's are module globals)."""
    from triton.runtime.jit import JITFunction

    return [obj for obj in gc.get_objects() if isinstance(obj, JITFunction)]


def compiled(kernels: list) -> int:
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:qwen3-8b-128k")
    parser.add_argument("--prompt-len", type=int, default=131000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--show", type=int, default=25)
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", speculation="off")
    config.max_model_len = 2 * args.prompt_len + 1024
    engine = EngineCore(config)
    vocab = engine.model_config.vocab_size
    long_prompt = random_prompts(1, args.prompt_len, vocab, seed=2)[0]
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, 64, vocab, seed=1)):
        engine.add_request(f"stream-{i}", prompt, params)
    for _ in range(50):
        engine.step()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    kernels = triton_kernels()
    rows = []
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds and engine.has_work():
        mallocs = torch.cuda.memory_stats()["segment.all.allocated"]
        compiles = compiled(kernels)
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        s = engine.stats
        new_mallocs = torch.cuda.memory_stats()["segment.all.allocated"] - mallocs
        new_compiles = compiled(kernels) - compiles
        rows.append(
            (seconds, s.last_step_seconds, s.last_step_decodes, s.last_step_prefill_tokens,
             s.last_step_prefill_layers, new_mallocs, new_compiles, s.steps)
        )  # fmt: skip
    decode_only = [r[0] for r in rows if r[3] == 0]
    normal = statistics.median(decode_only) if decode_only else float("nan")
    print(f"{len(rows)} steps, decode-only median {normal * 1e3:.2f} ms")
    print(f"steps with a cudaMalloc: {sum(1 for r in rows if r[5])}")
    print("step  total_ms  forward_ms  decodes  tokens  layers  cudaMallocs  compiles")
    for r in sorted(rows, reverse=True)[: args.show]:
        print(
            f"{r[7]:5d} {r[0] * 1e3:9.2f} {r[1] * 1e3:10.2f} {r[2]:8d} {r[3]:7d} {r[4]:7d} "
            f"{r[5]:12d} {r[6]:9d}"
        )
    print("total cudaMallocs in slow steps (> 2x normal):",
          sum(r[5] for r in rows if r[0] > 2 * normal),
          "of", sum(r[5] for r in rows))  # fmt: skip


if __name__ == "__main__":
    main()
