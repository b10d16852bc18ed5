"""Where in a long prompt do a fairness run's slow steps fall, and what ran around them?

Reads the `steps` that `kamado bench --fairness` keeps (one row per engine step beside
the prompt) and prints, per quarter of the steps: the ratios of steps with prompt work
(median, p99, worst), the median of decode-only ones, and the pacer's slack; how many of
the 40 slowest steps ran a chunk of a size tried anew (larger than any in the 40 steps
before); and the slowest steps, each with the steps around it. Where the same chunk's
neighbours took as long, the pacer misjudged its cost; where only the one step is slow,
the machine was.

    python scripts/fairness_steps.py bench/results/FILE.json [--worst 5] [--around 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


GROWTH_STEPS = 40  # a chunk larger than any of this many steps before it: a size tried anew


def grew(rows: list[dict], i: int) -> bool:
    """Whether step i ran a chunk larger than any in the GROWTH_STEPS steps before it."""
    before = [r["prefill_tokens"] for r in rows[max(0, i - GROWTH_STEPS) : i]]
    return bool(before) and rows[i]["prefill_tokens"] > max(before)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("results")
    parser.add_argument("--worst", type=int, default=5)
    parser.add_argument("--around", type=int, default=6)
    args = parser.parse_args()
    for run in json.loads(Path(args.results).read_text())["results"]:
        rows = [dict(zip(run["step_columns"], row, strict=True)) for row in run["steps"]]
        print(f"{run['scheduler']}: {len(rows)} steps, worst {run['worst_ratio']:.3f}x")
        print("quarter  prompt tokens   with prompt work: median  p99   worst  decode-only  slack")
        for part in range(4):
            quarter = rows[part * len(rows) // 4 : (part + 1) * len(rows) // 4]
            paced = [r["ratio"] for r in quarter if r["prefill_tokens"] and r["ratio"]]
            alone = [r["ratio"] for r in quarter if not r["prefill_tokens"] and r["ratio"]]
            print(
                f"{part + 1:7d}  {quarter[0]['prompt_done']:5d}-{quarter[-1]['prompt_done']:5d}"
                f"   {statistics.median(paced):22.3f} {quantile(paced, 0.99):5.3f} "
                f"{max(paced):6.3f}  {statistics.median(alone) if alone else 0:11.3f}"
                f"  {statistics.median(r['slack_ms'] for r in quarter):5.1f} ms"
            )
        at = {r["step"]: i for i, r in enumerate(rows)}
        ranked = sorted(rows, key=lambda r: -r["ratio"])
        slowest = ranked[:GROWTH_STEPS]
        grown = [r for r in slowest if grew(rows, at[r["step"]])]
        print(
            f"of the {len(slowest)} slowest steps, {len(grown)} ran a chunk larger than any in "
            f"the {GROWTH_STEPS} steps before it: " + ", ".join(f"{r['ratio']:.3f}x" for r in grown)
        )
        for slow in ranked[: args.worst]:
            i = at[slow["step"]]
            print(f"step {slow['step']} at {slow['ratio']:.3f}x, with the steps around it:")
            for r in rows[max(0, i - args.around) : i + args.around + 1]:
                faults = f", {r['minor_faults']} faults" if "minor_faults" in r else ""
                print(
                    f"  {'>' if r is slow else ' '} step {r['step']}: {r['step_ms']:6.1f} ms, "
                    f"{r['prefill_tokens']:3d} tokens x {r['prefill_layers']} layers, prompt at "
                    f"{r['prompt_done']}, waited {r['waited_ms']:.1f} ms{faults}, {r['ratio']:.3f}x"
                )


if __name__ == "__main__":
    main()
