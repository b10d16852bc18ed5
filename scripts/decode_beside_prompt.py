"""Do decode-only steps run slower while a paced prompt waits beside them?

Three streams decode; in each round they run alone for a while, then beside a paced
16k-token prompt, which is then aborted. A step that carried no prompt work beside the
prompt is compared with the alone steps on either side of it, so the machine's drift
(10-20% within minutes on this project's CPU) falls on both. The fairness benchmark's
local normal (`kamado bench --fairness`, Fairness.local) rests on these steps running at
the streams' own pace.

    .venv/bin/python scripts/decode_beside_prompt.py [--context 1024] [--rounds 4]
        [--beside 150] [--alone 30]
"""

from __future__ import annotations

import argparse
import statistics

from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams

STREAMS = 3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--context", type=int, default=1024, help="the streams' prompt length")
    p.add_argument("--prompt-len", type=int, default=16384)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--beside", type=int, default=150, help="steps beside the prompt a round")
    p.add_argument("--alone", type=int, default=30, help="steps alone before each round")
    args = p.parse_args()
    # Speculation off: one token a step, so a step is a gap.
    config = EngineConfig(
        model=args.model, max_model_len=2 * args.prompt_len + 1024, speculation="off"
    )
    engine = EngineCore(config)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(STREAMS, args.context, vocab, seed=1)):
        engine.add_request(f"stream-{i}", prompt, params)
    while len(engine.step()) < STREAMS:  # the streams' prompts
        pass
    long_prompt = random_prompts(1, args.prompt_len, vocab, seed=2)[0]

    def steps(n: int) -> list[tuple[float, int]]:
        """(forward-pass seconds, prompt tokens) of n steps that gave every stream a token."""
        out = []
        while len(out) < n:
            if len(engine.step()) >= STREAMS:
                out.append((engine.stats.last_step_seconds, engine.stats.last_step_prefill_tokens))
        return out

    alone = [steps(args.alone)]
    beside = []
    for rnd in range(args.rounds):
        engine.add_request(f"long-{rnd}", long_prompt, SamplingParams(max_tokens=1))
        beside.append(steps(args.beside))
        engine.abort(f"long-{rnd}")
        alone.append(steps(args.alone))

    def ms(rows: list[tuple[float, int]]) -> float:
        return statistics.median(s for s, _ in rows) * 1e3

    ratios = []
    for rnd, rows in enumerate(beside):
        # The first steps alone after an abort or a start are skipped: they warm up.
        before, after = ms(alone[rnd][5:]), ms(alone[rnd + 1][5:])
        decode_only = [r for r in rows if r[1] == 0]
        with_prompt = [r for r in rows if r[1] > 0]
        if not decode_only:
            print(f"round {rnd}: no step without prompt work beside it (raise --beside)")
            continue
        ratio = ms(decode_only) / ((before + after) / 2)
        ratios.append(ratio)
        print(
            f"round {rnd}: alone before {before:.1f} ms, after {after:.1f}; beside the "
            f"prompt, steps without prompt work {ms(decode_only):.1f} ({len(decode_only)} "
            f"steps, {ratio:.2f}x the alone mean), steps with it {ms(with_prompt):.1f} "
            f"({len(with_prompt)})",
            flush=True,
        )
    if ratios:
        print(
            f"steps without prompt work beside it / alone: median {statistics.median(ratios):.2f}x"
        )


if __name__ == "__main__":
    main()
