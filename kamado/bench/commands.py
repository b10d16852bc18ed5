"""`kamado bench`: throughput beside transformers, decode fairness beside a long prefill,
constrained vs unconstrained decoding, or speculation on vs off. `kamado replay`: agent
traces, written or replayed against a server."""

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
    if args.spec:
        from kamado.bench.spec import run_spec_bench

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_spec_bench(
            model, args.dtype, args.gen_len or 256, args.speculation, args.repeats
        )
        write_results(args.out, "spec", results)
        return 0
    if args.spec_verify:
        from kamado.bench.spec_verify import run_spec_verify

        model = (args.model or ["synthetic:qwen3-8b-128k"])[0]
        results = run_spec_verify(model, context=args.prompt_len or 1024)
        write_results(args.out, "spec-verify", results)
        return 0
    if args.structured:
        from kamado.bench.structured import run_structured

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_structured(model, args.dtype, args.gen_len or 64, args.tokenizer)
        write_results(args.out, "structured", results)
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


def cmd_replay(args: argparse.Namespace) -> int:
    from kamado.bench.trace import generate_trace, read_trace, write_trace

    if args.replay_command == "make-trace":
        turns = generate_trace(
            agents=args.agents,
            max_context_tokens=args.max_context,
            new_tokens_per_turn=args.new_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
        )
        write_trace(args.out, turns)
        print(f"{len(turns)} turns of {args.agents} agents written to {args.out}")
        return 0
    turns = read_trace(args.trace)
    if args.replay_command == "compare":
        from kamado.bench.replay_servers import compare

        results = compare(args.model, turns, args.serve_arg or [])
        write_results(args.out, "replay-compare", {"trace": args.trace, **results})
        return 0
    import asyncio

    from kamado.bench.replay import format_summary, replay

    summary = asyncio.run(replay(args.url, turns, args.model or ""))
    print(format_summary(args.url, summary))
    write_results(args.out, "replay", {"trace": args.trace, "url": args.url, **summary})
    return 1 if summary["errors"] else 0
