"""`kamado bench --spec-verify`: what verifying k draft tokens per sequence costs beside a
plain decode step, at several batch sizes; the controller's step-cost model
(kamado/spec/controller.py) is what these figures calibrate.

Each sequence first prefills `context` tokens. Then the same step is timed again and
again without advancing: a plain decode (one token per sequence, run as the engine runs
it: from a CUDA graph where one is captured) and a verification of 1 + k tokens per
sequence (the eager path the engine takes for it). Wall time includes the host's share.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.engine.scheduler import ScheduledSeq
from kamado.kv.cache import bytes_per_block
from kamado.models import load_model_config, resolve_model

REPS = {"cuda": 10, "cpu": 3}  # the CPU run is a check of the command, not a measurement


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _timed_ms(fn, device: str) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(REPS[device]):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def run_spec_verify(
    model: str,
    batches: tuple[int, ...] = (1, 4, 16),
    drafts: tuple[int, ...] = (1, 2, 4, 8, 16),
    context: int = 1024,
) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = load_model_config(resolve_model(model))
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tokens = max(batches) * (context + max(drafts) + 32)
    kv_bytes = int(bytes_per_block(config, 16, dtype) * (tokens // 16 + 1) * 1.1)
    engine = EngineCore(
        EngineConfig(
            model=model, device=device, dtype=str(dtype).removeprefix("torch."),
            kv_cache_bytes=kv_bytes, max_num_seqs=max(batches),
            max_num_batched_tokens=max(batches) * context, speculation="off",
            overlap_decode=False,  # it runs steps on the runner itself, one at a time
        )
    )  # fmt: skip
    rng = random.Random(0)
    rows = []
    for batch in batches:
        for i in range(batch):
            prompt = [rng.randrange(config.vocab_size) for _ in range(context)]
            params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            engine.add_request(f"b{batch}-{i}", prompt, params)
        while len(engine.scheduler.running) < batch or engine.scheduler.waiting:
            engine.step()  # prefill; each sequence has sampled its first token
        seqs = list(engine.scheduler.running)
        for s in seqs:
            assert engine.scheduler._reserve(s, 1 + max(drafts))  # blocks for every k
        plain = [ScheduledSeq(s, 1) for s in seqs]
        decode_ms = _timed_ms(lambda plain=plain: engine.runner.execute(plain), device)
        row = {"batch": batch, "context": context, "decode_ms": decode_ms, "verify": []}
        for k in drafts:
            items = [
                ScheduledSeq(s, 1 + k, [rng.randrange(config.vocab_size) for _ in range(k)])
                for s in seqs
            ]
            ms = _timed_ms(lambda items=items: engine.runner.execute(items), device)
            row["verify"].append({"k": k, "ms": ms, "ratio": ms / decode_ms})
        ks = [0] + [v["k"] for v in row["verify"]]
        ms_all = [decode_ms] + [v["ms"] for v in row["verify"]]
        per_token, fixed = statistics.linear_regression([batch * (1 + k) for k in ks], ms_all)
        row["fit_fixed_ms"], row["fit_per_token_ms"] = fixed, per_token
        row["per_token_share"] = per_token / fixed if fixed > 0 else float("inf")
        rows.append(row)
        print(
            f"batch {batch:2d}: decode {decode_ms:7.2f} ms; verify "
            + ", ".join(f"k={v['k']} {v['ratio']:.2f}x" for v in row["verify"])
            + f"; per-token / fixed = {row['per_token_share']:.4f}",
            flush=True,
        )
        for s in seqs:
            engine.abort(s.request_id)
    return {"model": model, "device": device, "dtype": str(dtype), "rows": rows}
