"""Where does a batch-1 decode step's GPU time go? (CUDA)

Runs decode steps of one sequence on the engine (CUDA graphs, overlap, as served) under
torch.profiler and prints, per step: the GPU's span from the first kernel to the last,
time inside kernels, idle time between them, and the kernels by total time, grouped as
matmul, attention and the rest. The span against the bytes the step reads says how far
from the copy-bandwidth roofline each part leaves decode.

    python scripts/decode_profile.py [--bf16] [--surgery fp8] [--steps 20] [--pdl on|off|both]
        [--dense-gemv on|off|both]

--dense-gemv off runs bf16 projections and the head through cuBLAS at every batch size,
not through the GEMV of triton_matmul.dense_matmul.

With programmatic dependent launch (kamado.pdl) kernels overlap: a kernel launched early
counts its wait, so the span, not the sum over kernels, is the step's GPU time.
"""

from __future__ import annotations

import argparse
import itertools
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kamado import pdl as pdl_module
from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.surgery import triton_matmul

MATMUL_MARKS = ("gemv", "gemm", "nvjet", "cutlass", "sm90_", "_rowwise", "_dot_kernel", "splitk")
WARM_STEPS = 100
TIMED_STEPS = 200
ATTENTION_MARKS = ("attention", "attn", "decode_kernel", "_paged")
SWITCH = {"on": [True], "off": [False], "both": [False, True]}


def kind_of(name: str) -> str:
    low = name.lower()
    if any(m in low for m in MATMUL_MARKS):
        return "matmul"
    if any(m in low for m in ATTENTION_MARKS):
        return "attention"
    return "other"


def profile_decode(
    model: str, surgery: tuple[str, ...], steps: int, show: int, pdl: bool, dense_gemv: bool
) -> None:
    pdl_module.enabled = pdl
    triton_matmul.dense_gemv = dense_gemv
    config = EngineConfig(
        model=model, device="cuda", dtype="bfloat16", speculation="off", surgery=surgery,
        kv_cache_bytes=2 << 30, max_num_seqs=4,
    )  # fmt: skip
    engine = EngineCore(config)
    prompt = random_prompts(1, 512, engine.model_config.vocab_size)[0]
    max_tokens = WARM_STEPS + TIMED_STEPS + steps + 10
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("profiled", prompt, params)
    for _ in range(WARM_STEPS):  # prefill, then decode long enough to be steady
        engine.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(TIMED_STEPS):
        engine.step()
    torch.cuda.synchronize()
    tok_s = TIMED_STEPS / (time.perf_counter() - started)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    busy = sum(e.time_range.end - e.time_range.start for e in kernels)
    per_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        per_name[e.name].append(e.time_range.end - e.time_range.start)
    per_kind: dict[str, float] = defaultdict(float)
    for name, times in per_name.items():
        per_kind[kind_of(name)] += sum(times)
    label = ("+".join(surgery) or "bf16") + ("" if pdl else ", PDL off")
    label += "" if dense_gemv else ", dense GEMV off"
    print(f"\n== {model} {label}: decode {tok_s:.1f} tok/s at batch 1 ({TIMED_STEPS} steps)")
    print(f"profiled {steps} steps:")
    print(
        f"per step: GPU span {span / steps:8.1f} us, in kernels {busy / steps:8.1f} us, "
        f"idle {(span - busy) / steps:7.1f} us, kernels {len(kernels) / steps:.0f}"
    )
    for kind in ("matmul", "attention", "other"):
        print(f"  {kind:9s} {per_kind[kind] / steps:8.1f} us/step")
    print("  us/step  count/step  us/call  kind       kernel")
    top = sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:show]
    for name, times in top:
        total = sum(times)
        print(
            f"  {total / steps:7.1f}  {len(times) / steps:10.1f}  {total / len(times):7.2f}"
            f"  {kind_of(name):9s}  {name[:110]}"
        )
    del engine
    torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:qwen3-8b")
    parser.add_argument("--surgery", action="append", default=[], help="one run per value")
    parser.add_argument("--bf16", action="store_true", help="also a run without surgery")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--show", type=int, default=25)
    parser.add_argument("--pdl", choices=SWITCH, default="on")
    parser.add_argument("--dense-gemv", choices=SWITCH, default="on")
    args = parser.parse_args()
    runs = ([()] if args.bf16 or not args.surgery else []) + [(s,) for s in args.surgery]
    for surgery in runs:
        for pdl, dense_gemv in itertools.product(SWITCH[args.pdl], SWITCH[args.dense_gemv]):
            profile_decode(args.model, surgery, args.steps, args.show, pdl, dense_gemv)


if __name__ == "__main__":
    main()
