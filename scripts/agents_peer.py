"""`kamado bench --agents` with the prefix cache on, for two source trees of kamado in turn
(say a change and the commit before it), each run in its own process: prompt tokens each
follow-up turn computes, and follow-up time to first token.

    git archive BASE | tar -x -C /tmp/base
    PYTHONPATH=$PWD python scripts/agents_peer.py OUT.json /tmp/base . [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from kamado.bench.report import commit, machine

# Run inside each tree: one session of agents, the per-turn record as JSON on stdout.
CHILD = """
import json, sys
import kamado
from kamado.bench.agents import run_agents
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
model, agents, context, new, turns, gen = sys.argv[1], *map(int, sys.argv[2:])
engine = EngineCore(EngineConfig(model=model))
run_agents(engine, 1, 48, 16, 1, 4, seed=99)  # warm-up, as the bench does
print(kamado.__file__)
print(json.dumps(run_agents(engine, agents, context, new, turns, gen)))
"""


def run_tree(tree: str, args: argparse.Namespace) -> dict:
    workload = [args.agents, args.context, args.new_tokens, args.turns, args.gen_len]
    tree = os.path.abspath(tree)
    out = subprocess.run(  # in the tree: `python -c` puts the working directory first
        [sys.executable, "-c", CHILD, args.model, *map(str, workload)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
        capture_output=True,
        text=True,
        check=True,
    )
    imported, line = out.stdout.splitlines()[-2:]
    assert imported.startswith(tree + "/"), f"{tree} ran the kamado of {imported}"
    result = json.loads(line)
    follow = [t for t in result["per_turn"] if t["turn"] > 0]
    return {
        "computed_per_follow_up": [t["prompt_tokens"] - t["cached_tokens"] for t in follow],
        "ttft_follow_ups_median_s": result["ttft_follow_ups"]["median_s"],
        "prefix_hit_rate_follow_ups": result["prefix_hit_rate_follow_ups"],
        "wall_s": result["wall_s"],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("trees", nargs=2)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--agents", type=int, default=4)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--gen-len", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {tree: [] for tree in args.trees}
    for _ in range(args.repeats):  # interleaved, so load from other processes hits both
        for tree in args.trees:
            r = run_tree(tree, args)
            runs[tree].append(r)
            computed = statistics.mean(r["computed_per_follow_up"])
            print(
                f"{tree}: {computed:.1f} prompt tokens computed per follow-up turn, "
                f"hit rate {r['prefix_hit_rate_follow_ups']:.2%}, "
                f"follow-up TTFT median {r['ttft_follow_ups_median_s']:.3f}s"
            )
    record = {
        "benchmark": "agents-peer",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine(),
        "commit": commit(),
        "command": "python " + " ".join(sys.argv),
        "workload": vars(args),
        "runs": runs,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=2)


if __name__ == "__main__":
    main()
