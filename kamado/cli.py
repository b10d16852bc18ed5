"""`kamado serve | pull | models | bench | replay | chat | surgery`: one entry point, a module
each."""

from __future__ import annotations

import argparse
import sys

from kamado.config import DEFAULT_MODEL, KV_CACHE_DTYPES, EngineConfig
from kamado.structured.tool_formats import TOOL_FORMATS
from kamado.surgery.names import parse_surgery


def _surgery(text: str) -> tuple[str, ...]:
    try:
        return parse_surgery(text)
    except ValueError as e:  # argparse prints the message and exits
        raise argparse.ArgumentTypeError(str(e)) from None


def _kv_formats(text: str) -> tuple[str, ...]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in KV_CACHE_DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown KV cache dtype {unknown[0]!r}; available: {', '.join(KV_CACHE_DTYPES)}"
        )
    return ("auto", *dict.fromkeys(n for n in names if n != "auto"))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _stall_factor(text: str) -> float:
    """A pacing bound: a multiple of a decode-only step, at least 1 (inf: no pacing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, not {text!r}") from None
    if not value >= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be at least 1 (inf: no pacing), not {text}")
    return value


def _add_decode_stall_factor(p: argparse.ArgumentParser, applies_to: str = "") -> None:
    p.add_argument(
        "--decode-stall-factor",
        type=_stall_factor,
        default=EngineConfig.decode_stall_factor,
        help=applies_to
        + "a step with prompt work beside running decodes takes at most this many times "
        "a decode-only step: lower keeps streams smoother and prefills long prompts more "
        "slowly; inf turns pacing off (default: %(default)s)",
    )


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="start the OpenAI-compatible server")
    p.add_argument("--model", default=DEFAULT_MODEL, help="named model, .gguf file or HF dir")
    p.add_argument("--listen", default="127.0.0.1:8091", help="HOST:PORT to listen on")
    p.add_argument("--served-model-name", default=None, help="model id reported to clients")
    p.add_argument("--chat-template", default=None, help="jinja file overriding the model's")
    p.add_argument(
        "--chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="template variables for every request, e.g. '{\"enable_thinking\": false}'",
    )
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--kv-cache-gb", type=float, default=None, help="KV cache budget in GiB")
    p.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="KV cache storage: the model's dtype, or 8-bit codes with scales per token (1.9x "
        "the tokens of bf16) or calibrated per layer (fp8-static: 2x)",
    )
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-queued", type=int, default=256, help="requests waiting before 503")
    p.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        help="CPU threads for the model (default: the cores other processes leave idle)",
    )
    p.add_argument(
        "--no-prefix-cache", action="store_true", help="recompute every prompt from scratch"
    )
    p.add_argument(
        "--kv-host-gb",
        type=float,
        default=None,
        help="host-RAM tier for KV blocks a GPU evicts, in GiB (default: a quarter of RAM up "
        "to 8 on CUDA; none on CPU, where blocks go straight to disk)",
    )
    p.add_argument(
        "--kv-disk-dir",
        default=None,
        help="disk tier for evicted KV blocks (default: $KAMADO_HOME/kv-cache)",
    )
    p.add_argument(
        "--kv-disk-gb", type=float, default=8.0, help="disk tier size cap in GiB (0 = off)"
    )
    p.add_argument(
        "--no-bare-json-tool-calls",
        action="store_true",
        help="do not turn a reply that is only a JSON tool call into tool_calls",
    )
    p.add_argument(
        "--surgery",
        type=_surgery,
        default=(),
        help="load-time surgery, comma-separated: fuse int8 int4 fp8 gguf "
        "kv-fp8 kv-fp8-static kv-int8",
    )
    _add_decode_stall_factor(p)
    p.add_argument(
        "--short-turn-stall-factor",
        type=_stall_factor,
        default=EngineConfig.short_turn_stall_factor,
        help="the same bound while an agent's follow-up turn (at most 2,048 new prompt "
        "tokens) is prefilled, whose time to first token the agent waits on "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--speculation",
        default="auto",
        help="speculative decoding: auto (n-gram + suffix drafts, adaptive), off, ngram, "
        "suffix, or draft:MODEL (a small model with the same tokenizer)",
    )
    p.add_argument(
        "--spec-max-draft", type=int, default=8, help="most draft tokens per sequence and step"
    )
    p.add_argument(
        "--tool-call-format",
        default=None,
        choices=TOOL_FORMATS,
        help="how the model writes tool calls (default: read from the chat template)",
    )


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="talk to a running server from the terminal")
    p.add_argument("--url", default="http://127.0.0.1:8091/v1")
    p.add_argument("--model", default=None, help="model id (default: the server's first)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--max-tokens", type=int, default=1024)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="offline throughput and fairness benchmarks")
    p.add_argument("--model", action="append", help="model(s) to benchmark (repeatable)")
    p.add_argument("--fairness", action="store_true", help="decode gaps beside a long prefill")
    _add_decode_stall_factor(p, applies_to="--fairness: ")
    p.add_argument(
        "--structured", action="store_true", help="constrained vs unconstrained decoding"
    )
    p.add_argument(
        "--gpu", action="store_true", help="CUDA decode/prefill against measured ceilings"
    )
    p.add_argument(
        "--contention", action="store_true", help="decode beside a busy process, by thread policy"
    )
    p.add_argument(
        "--agents",
        type=int,
        default=None,
        metavar="N",
        help="N agents' turns in token ids, prefix cache on then off (contexts: --prompt-len)",
    )
    p.add_argument("--new-tokens", type=int, default=1024, help="--agents: new tokens a turn")
    p.add_argument("--turns", type=int, default=4, help="--agents: follow-up turns per agent")
    p.add_argument("--device", default="cpu", help="--agents, --fairness: cpu or cuda")
    p.add_argument("--kv-cache", action="store_true", help="int8/fp8 KV cache vs the model's dtype")
    p.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV budget (--kv-cache)")
    p.add_argument(
        "--kv-formats",
        type=_kv_formats,
        default=KV_CACHE_DTYPES,
        help="--kv-cache: the formats, comma-separated (auto always first; default: all). "
        "Each is an engine with its own weights, all alive at once",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help="sequences at once (--kv-cache, and --gpu --surgery's second batch: default 4; "
        "throughput: default 1, then 8)",
    )
    p.add_argument(
        "--surgery",
        type=_surgery,
        action="append",
        help="with --gpu: batch-1 decode per surgery variant beside bf16 (repeatable)",
    )
    p.add_argument("--spec", action="store_true", help="decode speed, speculation on vs off")
    p.add_argument(
        "--speculation",
        default="auto",
        help="--spec: the speculation mode to compare with off; --agents: the mode to run",
    )
    p.add_argument(
        "--spec-verify",
        action="store_true",
        help="cost of verifying k draft tokens beside a plain decode step (GPU, or tiny on CPU)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="--spec, --structured: runs of each task and mode; throughput: runs of each "
        "engine and batch, alternated (the median is kept)",
    )
    p.add_argument("--prompt-len", type=int, default=None)
    p.add_argument("--gen-len", type=int, default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--no-peer",
        action="store_true",
        help="skip the baseline: transformers side by side (--agents: the cache-off run)",
    )
    p.add_argument("--tokenizer", default=None, help="HF tokenizer dir (--structured, synthetic)")
    p.add_argument("--out", default=None, help="write raw results JSON here")


def _add_replay(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="write or replay multi-agent traces (JSONL)")
    rsub = p.add_subparsers(dest="replay_command", required=True)
    make = rsub.add_parser("make-trace", help="write synthetic coding-agent sessions")
    make.add_argument("--out", required=True)
    make.add_argument("--agents", type=int, default=4)
    make.add_argument("--max-context", type=int, default=8192, help="tokens a session grows to")
    make.add_argument("--new-tokens", type=int, default=1000, help="new prompt tokens a turn")
    make.add_argument("--max-tokens", type=int, default=16, help="max_tokens of each request")
    make.add_argument(
        "--system-tokens", type=int, default=0, help="grow the shared system prompt to this"
    )
    make.add_argument("--seed", type=int, default=0)
    run = rsub.add_parser("run", help="replay a trace against a running server")
    run.add_argument("trace")
    run.add_argument("--url", default="http://127.0.0.1:8091/v1")
    run.add_argument("--model", default=None, help="model field (default: the server's)")
    run.add_argument("--out", default=None, help="write raw results JSON here")
    run.add_argument(
        "--soak",
        default=None,
        metavar="DURATION",
        help="replay in a loop for DURATION (90s, 30m, 2h), watching memory and KV blocks",
    )
    run.add_argument("--window", type=float, default=60.0, help="--soak report interval, s")
    both = rsub.add_parser(
        "compare",
        help="replay against kamado, prefix cache on, then off; or kamado, then a peer server",
    )
    both.add_argument("trace")
    both.add_argument("--model", default=DEFAULT_MODEL)
    both.add_argument("--serve-arg", action="append", help="extra `kamado serve` argument")
    peer = both.add_mutually_exclusive_group()
    peer.add_argument("--peer-url", default=None, help="a running peer's OpenAI base URL")
    peer.add_argument(
        "--peer-command",
        default=None,
        help="shell command starting a peer on {port}; stopped after its replay",
    )
    both.add_argument("--peer-name", default="peer", help="the peer's column in the report")
    both.add_argument("--out", default=None, help="write raw results JSON here")


def _add_surgery(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("surgery", help="check what load-time surgery costs in fidelity")
    ssub = p.add_subparsers(dest="surgery_command", required=True)
    check = ssub.add_parser("check", help="surgery variants beside the unmodified model")
    check.add_argument("model", help="named model, .gguf file, HF dir or synthetic:<shape>")
    check.add_argument(
        "--surgery",
        type=_surgery,
        action="append",
        help="one variant, e.g. int8 or gguf,fuse (repeatable)",
    )
    check.add_argument("--device", default="cpu")
    check.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    check.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    check.add_argument("--out", default=None, help="write raw results JSON here")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kamado", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    p = sub.add_parser("pull", help="download and verify a named model")
    p.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    sub.add_parser("models", help="list named and cached models")
    _add_bench(sub)
    _add_replay(sub)
    _add_chat(sub)
    _add_surgery(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Imports are per command so `kamado pull` never loads torch or the server stack.
    if args.command == "serve":
        from kamado.server.commands import cmd_serve as run
    elif args.command == "pull":
        from kamado.models.commands import cmd_pull as run
    elif args.command == "models":
        from kamado.models.commands import cmd_models as run
    elif args.command == "bench":
        from kamado.bench.commands import cmd_bench as run
    elif args.command == "replay":
        from kamado.bench.commands import cmd_replay as run
    elif args.command == "surgery":
        from kamado.surgery.commands import cmd_surgery as run
    else:
        from kamado.server.chat_client import cmd_chat as run
    return run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
