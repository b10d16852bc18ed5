"""`kamado bench`: throughput beside transformers, or decode fairness beside a long prefill."""

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
    if args.gpu:
        from kamado.bench.gpu import run_gpu_bench

        model = (args.model or ["synthetic:qwen3-8b-128k"])[0]
        results = run_gpu_bench(
            model, prompt_len=args.prompt_len or 512, gen_len=args.gen_len or 128,
            peer=not args.no_peer,
        )  # fmt: skip
        write_results(args.out, "gpu", results)
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
