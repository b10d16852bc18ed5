"""Where do the slow steps beside a long prompt go? (CUDA)

Three streams decode while a long prompt goes a few layers a step, as in
`kamado bench --fairness`. For every step it records the step's time, the chunk it ran,
and what happened on the host besides the model: device allocations the caching allocator
had to make (cudaMalloc), and Triton kernels compiled. It prints the slowest steps.

With --prefix N, a prompt of the long prompt's first N tokens is prefilled alone first,
so the long prompt finds them cached and the probe starts N tokens deep. With
--profile K, the first K steps with prompt work run under torch.profiler: for each, its
wall time, the GPU's span and time in kernels, and its kernels by total time.

With --host, the host's time in the step's main calls (scheduling, building attention
metadata, launching layers, reading tokens): per call, the mean over steps with prompt
work against decode-only steps. A call that waits for the device shows as a long one.

With --finish, the host's work after the tokens are read (the fairness bench's
`finish_ms`), for the slowest such stretches: its wall time against the thread's own CPU
time (a thread kept waiting, for the GIL or the OS, shows as wall without CPU), the page
faults it took, each call in it, and the garbage collector's time.

    python scripts/staged_step_probe.py [--prompt-len 131000] [--seconds 60]
        [--prefix 100000] [--profile 4] [--host] [--finish]
"""

from __future__ import annotations

import argparse
import gc
import resource
import statistics
import threading
import time
from collections import defaultdict

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from kamado.bench.fairness import CollectionTimer
from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine import core
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams


def triton_kernels() -> list:
    """Every Triton kernel loaded so far (the engine's are module globals)."""
    from triton.runtime.jit import JITFunction

    return [obj for obj in gc.get_objects() if isinstance(obj, JITFunction)]


def compiled(kernels: list) -> int:
    return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())


def profile_steps(engine: EngineCore, steps: int, show: int) -> None:
    """Run steps until `steps` of them carried prompt work, each under the profiler."""
    profiled = 0
    while profiled < steps and engine.has_work():
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        s = engine.stats
        if not s.last_step_prefill_tokens:
            continue
        profiled += 1
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
        per_name: dict[str, list[float]] = defaultdict(list)
        for e in kernels:
            per_name[e.name].append(e.time_range.end - e.time_range.start)
        busy = sum(sum(t) for t in per_name.values())
        print(
            f"\nstep {s.steps}: {s.last_step_prefill_tokens} tokens x "
            f"{s.last_step_prefill_layers} layers beside {s.last_step_decodes} decodes: wall "
            f"{wall * 1e3:.2f} ms, GPU span {span / 1e3:.2f} ms, in kernels {busy / 1e3:.2f} ms"
        )
        print("   total_us  count  kernel")
        for name, times in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))[:show]:
            print(f"  {sum(times):9.1f}  {len(times):5d}  {name[:100]}")


class HostTimes:
    """Wraps methods (owner, name) to add up the host's time in each, per step."""

    def __init__(self, targets: list[tuple[object, str]]) -> None:
        self.step: dict[str, float] = defaultdict(float)
        for owner, name in targets:
            if owner is None:  # no CUDA graphs
                continue
            setattr(
                owner, name, self._timed(f"{type(owner).__name__}.{name}", getattr(owner, name))
            )

    def _timed(self, label: str, call):  # noqa: ANN001, ANN202
        def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            t0 = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.step[label] += time.perf_counter() - t0

        return timed


def host_times(engine: EngineCore, steps: int) -> None:
    """The host's time per call, in steps with prompt work and in decode-only ones."""
    runner = engine.runner
    times = HostTimes([
        (engine.scheduler, "schedule"), (runner, "launch"), (runner, "collect"),
        (runner, "_context"), (runner, "_run_staged"), (runner, "_staged_input"),
        (runner.forward, "run_layers"), (runner.forward, "logits"),
        (runner.graphs, "run"), (runner.backend, "build_metadata"),
        (engine.pacer, "observe"), (engine.pacer, "staged_layers"),
        (engine.pacer, "staged_chunk_tokens"),
    ])  # fmt: skip
    sums = {True: defaultdict(float), False: defaultdict(float)}
    counts = {True: 0, False: 0}
    walls = {True: 0.0, False: 0.0}
    for _ in range(steps):
        if not engine.has_work():
            break
        times.step.clear()
        t0 = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - t0
        prompt = engine.stats.last_step_prefill_tokens > 0
        counts[prompt] += 1
        walls[prompt] += wall
        for label, seconds in times.step.items():
            sums[prompt][label] += seconds
    n_p, n_d = max(counts[True], 1), max(counts[False], 1)
    print(f"\nhost ms per step: {counts[True]} steps with prompt work, {counts[False]} without")
    wall_p, wall_d = walls[True] / n_p * 1e3, walls[False] / n_d * 1e3
    print(f"  {'engine.step (wall)':34s} {wall_p:8.3f} {wall_d:8.3f}")
    for label in sorted(sums[True], key=lambda k: -sums[True][k]):
        print(
            f"  {label:34s} {sums[True][label] / n_p * 1e3:8.3f} "
            f"{sums[False].get(label, 0.0) / n_d * 1e3:8.3f}"
        )


def finish_times(engine: EngineCore, seconds: float, show: int) -> None:
    """The slowest stretches of host work after a step's tokens are read."""
    times = HostTimes([
        (engine, "_append"), (engine, "_update_stats"), (engine, "_count_computed"),
        (engine.pacer, "observe"),
    ])  # fmt: skip
    core.StepWork.of = times._timed("StepWork.of", core.StepWork.of)
    read: list[float] = [0.0, 0.0, 0]  # wall and thread time, page faults: collect's return
    collect = engine.runner.collect

    def faults() -> int:
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        return usage.ru_minflt + usage.ru_majflt

    def marked_collect(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        out = collect(*args, **kwargs)
        read[:] = [time.perf_counter(), time.thread_time(), faults()]
        return out

    engine.runner.collect = marked_collect
    collections = CollectionTimer()
    print(f"threads: {[t.name for t in threading.enumerate()]}")
    rows = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds and engine.has_work():
        times.step.clear()
        gc_before = collections.seconds
        engine.step()
        wall, cpu = time.perf_counter() - read[0], time.thread_time() - read[1]
        new_faults, gc_seconds = faults() - read[2], collections.seconds - gc_before
        s = engine.stats
        rows.append((wall, cpu, gc_seconds, s.steps, s.last_step_prefill_tokens,
                     s.last_step_prefill_layers, dict(times.step), new_faults))  # fmt: skip
    collections.close()
    walls = sorted(r[0] for r in rows)
    print(f"{len(rows)} steps; finish ms median {walls[len(walls) // 2] * 1e3:.3f}, "
          f"over 0.5 ms: {sum(1 for w in walls if w > 5e-4)}")  # fmt: skip
    print(f"page faults per finish: median {statistics.median(r[7] for r in rows)}")
    slowest = sorted(rows, key=lambda r: -r[0])[:show]
    for wall, cpu, gcs, step, tokens, layers, calls, n_faults in slowest:
        ranked = sorted(calls.items(), key=lambda kv: -kv[1])
        parts = " ".join(f"{k}={v * 1e3:.3f}" for k, v in ranked)
        print(f"step {step} ({tokens}x{layers}): wall {wall * 1e3:.3f} cpu {cpu * 1e3:.3f} "
              f"faults {n_faults} gc {gcs * 1e3:.3f} | {parts}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="synthetic:qwen3-8b-128k")
    parser.add_argument("--prompt-len", type=int, default=131000)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--show", type=int, default=25)
    parser.add_argument("--prefix", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0)
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--finish", action="store_true")
    args = parser.parse_args()
    config = EngineConfig(model=args.model, device="cuda", dtype="bfloat16", speculation="off")
    config.max_model_len = 2 * args.prompt_len + 1024
    engine = EngineCore(config)
    vocab = engine.model_config.vocab_size
    long_prompt = random_prompts(1, args.prompt_len, vocab, seed=2)[0]
    if args.prefix:
        engine.add_request("prefix", long_prompt[: args.prefix], SamplingParams(max_tokens=1))
        while engine.has_work():
            engine.step()
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(3, 64, vocab, seed=1)):
        engine.add_request(f"stream-{i}", prompt, params)
    for _ in range(50):
        engine.step()
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    if args.profile:
        profile_steps(engine, args.profile, args.show)
    if args.host:
        host_times(engine, 2000)
        return
    if args.finish:
        finish_times(engine, args.seconds, args.show)
        return
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
