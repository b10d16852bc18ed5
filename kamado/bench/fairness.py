"""Do decoding streams keep their pace while a long prompt is prefilled beside them?

Three streams decode; after a baseline window a long prompt arrives. We record every
inter-token gap of the streams until the long prompt has its first token, and report the
worst gap as a multiple of the median baseline gap. The same run is repeated without
pacing (chunked prefill at the full token budget, as general-purpose schedulers do).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams

STREAMS = 3
BASELINE_STEPS = 100


@dataclass
class Fairness:
    scheduler: str
    model: str
    prompt_len: int
    baseline_gap_ms: float  # median gap of the streams alone
    baseline_worst_gap_ms: float  # the machine's own jitter: worst gap of the streams alone
    worst_gap_ms: float
    p99_gap_ms: float
    worst_over_baseline: float
    prefill_seconds: float


def measure(engine: EngineCore, model: str, label: str, prompt_len: int) -> Fairness:
    vocab = engine.model_config.vocab_size
    stream = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(STREAMS, 64, vocab, seed=1)):
        engine.add_request(f"stream-{i}", prompt, stream)
    last: dict[str, float] = {}
    gaps: list[float] = []

    def step() -> set[str]:
        deltas = engine.step()
        now = time.perf_counter()
        for d in deltas:
            if d.request_id.startswith("stream") and d.request_id in last:
                gaps.append(now - last[d.request_id])
            last[d.request_id] = now
        return {d.request_id for d in deltas}

    while len(last) < STREAMS:  # prefill the streams
        step()
    for _ in range(BASELINE_STEPS):
        step()
    baseline, baseline_worst = statistics.median(gaps), max(gaps)
    gaps.clear()
    long_prompt = random_prompts(1, prompt_len, vocab, seed=2)[0]
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    started = time.perf_counter()
    while "long" not in step():
        pass
    prefill_seconds = time.perf_counter() - started
    for i in range(STREAMS):
        engine.abort(f"stream-{i}")
    gaps.sort()
    return Fairness(
        label,
        model,
        prompt_len,
        baseline * 1e3,
        baseline_worst * 1e3,
        gaps[-1] * 1e3,
        gaps[int(0.99 * (len(gaps) - 1))] * 1e3,
        gaps[-1] / baseline,
        prefill_seconds,
    )


def run_fairness(model: str, dtype: str, prompt_len: int, compare: bool = True) -> list[dict]:
    results = []
    configs = [("kamado (paced)", EngineConfig(model=model, dtype=dtype))]
    if compare:
        unpaced = EngineConfig(model=model, dtype=dtype, decode_stall_factor=float("inf"))
        configs.append(("unpaced chunked prefill", unpaced))
    for label, config in configs:
        config.max_model_len = prompt_len + 1024
        engine = EngineCore(config)
        r = measure(engine, model, label, prompt_len)
        print(
            f"{label:24s} {model}: {prompt_len}-token prompt beside {STREAMS} streams: "
            f"baseline gap {r.baseline_gap_ms:.1f} ms (worst alone {r.baseline_worst_gap_ms:.1f}), "
            f"worst beside the prompt {r.worst_gap_ms:.1f} ms ({r.worst_over_baseline:.2f}x), "
            f"p99 {r.p99_gap_ms:.1f} ms ({r.p99_gap_ms / r.baseline_gap_ms:.2f}x), "
            f"prefill took {r.prefill_seconds:.1f} s",
            flush=True,
        )
        results.append(asdict(r))
        del engine
    return results
