"""Host time of the engine loop's prefix-cache bookkeeping for an agent's follow-up turns:
the schedule() that admits each turn (block keys, lookups, taking the cached blocks), the
release of its blocks to the cache when it ends, and every step's time. A tiny random
model keeps the model's own share small, so what grows with the prompt is the bookkeeping
that stalls every other agent's decode step.

    python scripts/admission_cost.py [PROMPT_TOKENS]
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from tests.tiny_models import save_tiny_hf_model

TURNS = 4
NEW_TOKENS_A_TURN = 1000


def main() -> None:
    prompt_len = int(sys.argv[1]) if len(sys.argv) > 1 else 32768
    context = prompt_len + TURNS * (NEW_TOKENS_A_TURN + 8)
    path = Path(tempfile.mkdtemp()) / "tiny"
    save_tiny_hf_model(path, "qwen3", max_position_embeddings=context, eos_token_id=None)
    kv_bytes = context * 1024 * 2  # 1 KiB of K/V a token in this model, two turns' worth
    engine = EngineCore(EngineConfig(model=str(path), dtype="float32", kv_cache_bytes=kv_bytes))
    schedule, admitting = engine.scheduler.schedule, []

    def timed_schedule() -> list:
        started = time.perf_counter()
        batch = schedule()
        admitting.append(time.perf_counter() - started)
        return batch

    engine.scheduler.schedule = timed_schedule
    release, releasing = engine.prefix.release, []

    def timed_release(seq) -> None:  # a turn's end: its blocks go back to the cache
        started = time.perf_counter()
        release(seq)
        releasing.append(time.perf_counter() - started)

    engine.prefix.release = timed_release
    rng = random.Random(0)
    prompt = [rng.randrange(3, 128) for _ in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for turn in range(TURNS):
        engine.add_request(f"turn-{turn}", prompt, params, session="agent")
        admitting.clear()
        releasing.clear()
        steps, output = [], []
        while engine.has_work():
            started = time.perf_counter()
            for delta in engine.step():
                output += delta.new_token_ids
            steps.append(time.perf_counter() - started)
        # The first turn is a new prompt, computed whole; later ones find it cached.
        shown = [round(s * 1e3, 1) for s in steps] if turn else f"{len(steps)} steps"
        print(
            f"turn {turn}: {len(prompt)} prompt tokens; the admitting schedule() "
            f"{admitting[0] * 1e3:.2f} ms; releasing its blocks {sum(releasing) * 1e3:.2f} ms; "
            f"steps (ms): {shown}",
            flush=True,
        )
        prompt = prompt + output + [rng.randrange(3, 128) for _ in range(NEW_TOKENS_A_TURN)]


if __name__ == "__main__":
    main()
