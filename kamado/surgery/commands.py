"""`kamado surgery check MODEL --surgery ...`: fidelity, memory and speed of surgery
variants beside the unmodified model."""

from __future__ import annotations

import argparse

from kamado.bench.report import write_results


def cmd_surgery(args: argparse.Namespace) -> int:
    from kamado.models import resolve_model
    from kamado.surgery.check import run_check

    variants = list(args.surgery or [])
    if not variants:
        variants = [("int8",), ("int4",)]
        if resolve_model(args.model).kind == "gguf":
            variants.append(("gguf",))
    results = run_check(args.model, variants, args.device, args.dtype, args.new_tokens)
    write_results(args.out, "surgery-check", results)
    return 0
