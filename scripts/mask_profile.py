"""Where a constrained decode step's host time goes, beside a free one (for a GPU).

Runs `kamado bench --structured`'s batch-1 decode under cProfile, free and constrained in
turn, and prints each run's tokens/s, the mask timings and the functions that took longest.

    PYTHONPATH=$PWD python scripts/mask_profile.py --tokenizer DIR [--model M] [--gen-len N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from transformers import AutoTokenizer

from kamado.bench import structured
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.structured.guide import Guides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", required=True, help="a real model's tokenizer directory")
    parser.add_argument("--model", default="synthetic:qwen2.5-0.5b")
    parser.add_argument("--gen-len", type=int, default=256)
    args = parser.parse_args()
    engine = EngineCore(
        EngineConfig(model=args.model, dtype="bfloat16", device="cuda", speculation="off")
    )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = engine.model_config
    engine.guides = Guides(
        args.model, config.vocab_size, config.eos_token_ids, engine.runner.device, tokenizer
    )
    prompts = structured._prompts(tokenizer, 1)
    structured._run(engine, prompts, 8, True, "warm-up")
    for i, constrained in enumerate((False, True, False, True)):
        profile = cProfile.Profile()
        profile.enable()
        run = structured._run(engine, prompts, args.gen_len, constrained, f"p{i}-{time.time()}")
        profile.disable()
        print("===", structured._fmt(run))
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
