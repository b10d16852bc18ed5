"""`kamado bench`: throughput beside transformers, decode fairness beside a long prefill, or
constrained vs unconstrained decoding."""

from __future__ import annotations

import argparse

from kamado.bench.report import write_results

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.fairness:
        from kamado.bench.fairness import run_fairness

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_fairness(model, args.dtype, args.prompt_len or 16384, not args.no_peer)
        write_results(args.out, "fairness", results)
        return 0
    if args.structured:
        from kamado.bench.structured import run_structured

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_structured(model, args.dtype, args.gen_len or 64, args.tokenizer)
        write_results(args.out, "structured", results)
        return 0
    from kamado.bench.throughput import run_throughput

    results = run_throughput(
        args.model or DEFAULT_MODELS,
        args.dtype,
        args.prompt_len or 256,
        args.gen_len or 64,
        peer=not args.no_peer,
    )
    write_results(args.out, "throughput", results)
    return 0
