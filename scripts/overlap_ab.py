"""Decode tokens/s with steps launched ahead (overlap_decode) on and off, on one CUDA
engine, rounds interleaved so drift hits both alike.

    python scripts/overlap_ab.py [--model synthetic:qwen3-8b] [--surgery fp8] [--speculation auto]
"""

from __future__ import annotations

import argparse
import statistics

from kamado.bench.throughput import kamado_throughput
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="synthetic:qwen3-8b")
    p.add_argument("--surgery", action="append", default=[])
    p.add_argument("--batch", type=int, action="append", default=None)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--gen-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--speculation", default="off")
    args = p.parse_args()
    batches = args.batch or [1, 4, 16]
    config = EngineConfig(
        model=args.model, device="cuda", dtype="bfloat16", max_num_seqs=max(batches),
        surgery=tuple(args.surgery), enable_prefix_caching=False, speculation=args.speculation,
    )  # fmt: skip
    engine = EngineCore(config)
    weights = "+".join(args.surgery) or "bf16"
    print(f"{args.model}, {weights} weights, speculation {args.speculation}")
    kamado_throughput(engine, args.model, 1, 16, 4)  # warm-up
    print("batch  overlap off tok/s   overlap on tok/s   on/off   launched ahead (this batch)")
    for batch in batches:
        rates: dict[bool, list[float]] = {False: [], True: []}
        ahead_before = engine.stats.steps_launched_ahead
        for _ in range(args.rounds):
            for overlap in (False, True):
                engine.overlap = overlap
                r = kamado_throughput(engine, args.model, batch, args.prompt_len, args.gen_len)
                rates[overlap].append(r.decode_tok_s)
        off, on = statistics.median(rates[False]), statistics.median(rates[True])
        ahead = engine.stats.steps_launched_ahead - ahead_before
        print(
            f"{batch:5d}  {off:17.1f}  {on:17.1f}  {on / off:6.2f}x   "
            f"{ahead}   runs off {rates[False]} on {rates[True]}",
            flush=True,
        )


if __name__ == "__main__":
    main()
