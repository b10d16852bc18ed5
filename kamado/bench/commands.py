"""`kamado bench`: throughput beside transformers, decode fairness beside a long prefill,
constrained vs unconstrained decoding, or speculation on vs off. `kamado replay`: agent
traces, written or replayed against a server."""

from __future__ import annotations

import argparse
import sys

from kamado.bench.report import write_results

DEFAULT_MODELS = ["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"]


def cmd_bench(args: argparse.Namespace) -> int:
    if args.fairness:
        from kamado.bench.fairness import run_fairness

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_fairness(
            model, args.device, args.dtype, args.prompt_len or 16384, not args.no_peer,
            args.decode_stall_factor,
        )  # fmt: skip
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
        results = run_structured(
            model, args.dtype, args.gen_len or 64, args.tokenizer, repeats=args.repeats
        )
        write_results(args.out, "structured", results)
        return 0
    if args.agents:
        from kamado.bench.agents import run_agents_bench

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_agents_bench(
            model, args.device, args.dtype, args.agents, args.prompt_len or 4096,
            args.new_tokens, args.turns, args.gen_len or 32, baseline=not args.no_peer,
            speculation=args.speculation,
        )  # fmt: skip
        write_results(args.out, "agents", results)
        return 0
    if args.contention:
        from kamado.bench.contention import run_contention

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        results = run_contention(model, args.dtype, args.prompt_len or 64, args.gen_len or 48)
        write_results(args.out, "contention", results)
        return 0
    if args.kv_cache:
        import torch

        from kamado.bench.kv_cache import run_kv_cache_bench

        model = (args.model or ["qwen2.5-coder-0.5b-instruct"])[0]
        device = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            results = run_kv_cache_bench(
                model, device, args.dtype, int(args.kv_cache_gb * (1 << 30)), args.batch or 4,
                args.prompt_len or 2048, args.gen_len or 32, formats=args.kv_formats,
            )  # fmt: skip
        except ValueError as e:  # the budget cannot hold the batch
            print(f"kamado bench: {e}", file=sys.stderr)
            return 2
        write_results(args.out, "kv-cache", results)
        return 0
    if args.gpu and args.surgery:
        from kamado.bench.gpu_surgery import AGENTS, run_surgery_bench

        model = (args.model or ["synthetic:qwen3-8b"])[0]
        results = run_surgery_bench(
            model, args.surgery, prompt_len=args.prompt_len or 512, gen_len=args.gen_len or 128,
            agents=args.batch or AGENTS,
        )  # fmt: skip
        write_results(args.out, "gpu-surgery", results)
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
        batches=(args.batch,) if args.batch else (1, 8),
        peer=not args.no_peer,
        repeats=args.repeats,
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
            system_tokens=args.system_tokens,
        )
        write_trace(args.out, turns)
        print(f"{len(turns)} turns of {args.agents} agents written to {args.out}")
        return 0
    turns = read_trace(args.trace)
    if args.replay_command == "compare":
        from kamado.bench.replay_servers import compare, compare_with_peer

        serve_args = args.serve_arg or []
        if args.peer_url or args.peer_command:
            results = compare_with_peer(
                args.model, turns, serve_args, args.peer_name, args.peer_command, args.peer_url
            )
            kind = "replay-vs-peer"
        else:
            results, kind = compare(args.model, turns, serve_args), "replay-compare"
        write_results(args.out, kind, {"trace": args.trace, **results})
        return 0
    import asyncio

    if args.soak:
        from kamado.bench.soak import format_verdict, parse_duration, soak

        try:
            duration_s = parse_duration(args.soak)
        except ValueError as e:
            print(f"kamado replay: {e}", file=sys.stderr)
            return 2
        results = asyncio.run(soak(args.url, turns, duration_s, args.model or "", args.window))
        print(format_verdict(results["verdict"]))
        write_results(args.out, "soak", {"trace": args.trace, "url": args.url, **results})
        return 0 if results["verdict"]["passed"] else 1

    from kamado.bench.replay import format_table, replay

    summary = asyncio.run(replay(args.url, turns, args.model or ""))
    print(format_table({args.url: summary}))
    write_results(args.out, "replay", {"trace": args.trace, "url": args.url, **summary})
    return 1 if summary["errors"] else 0
