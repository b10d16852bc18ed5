"""`kamado bench --spec`: decode speed with speculation on and off, on the three kinds of
output an agent produces: (a) a file rewritten from its context with a small change,
(b) tool calls of an agent trace, (c) free-form prose.

Both engines are loaded side by side and run the same greedy requests alternately, so a
shared machine's load drifts over both alike; outputs must be identical. Decode speed is
tokens after the first over the time from the first to the last (prefill is the same for
both and not what speculation changes). In bf16 two logits can round to the same value, and
verifying several tokens at once rounds differently from one at a time: where outputs
differ, the first differing position is checked for such a tie in the off engine.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from kamado.bench.trace import SYSTEM, TOOLS, _source_file
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_tokenizer, resolve_model

TARGETS = {"edit": 1.8, "agent": 1.3, "prose": 0.95}


@dataclass
class SpecRun:
    task: str
    speculation: str
    repeat: int
    tokens: int  # generated, over all the task's requests
    decode_s: float
    decode_tok_s: float
    decode_steps: int  # forward passes after the first token: load-independent
    tokens_per_step: float
    drafted: int
    accepted: int
    outputs: list[list[int]]


def _edit_task(rng: random.Random, gen_len: int) -> list[list[dict[str, Any]]]:
    source = _source_file(rng, max(gen_len, 64))  # at least one function to rename
    old = source.split("def ", 1)[1].split("(", 1)[0]
    ask = (
        f"Here is `src/{old}.py`:\n\n```python\n{source}\n```\n\nRename the function "
        f"`{old}` to `{old}_v2` and output the whole updated file in a python code block, "
        "nothing else."
    )
    return [[{"role": "user", "content": ask}]]


def _agent_task(rng: random.Random, turns: int = 3) -> list[list[dict[str, Any]]]:
    """An agent's turns: each request replays the history so far and the model answers
    with its next tool call, often naming paths and code that the history shows."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "tests/test_cache.py::test_evict fails; fix it."},
    ]
    files = [f"src/{a}_{b}.py" for a, b in (rng.sample(["cache", "block", "queue"], 2),) * 3]
    results = [
        ("grep", {"pattern": "def evict"}, "\n".join(f"{f}:12:def evict(self):" for f in files)),
        ("read_file", {"path": files[0]}, _source_file(rng, 200)),
        ("bash", {"command": "python -m pytest -x -q tests/test_cache.py"}, "1 failed"),
    ]
    conversations = []
    for i, (name, args, result) in enumerate(results[:turns]):
        call = {"id": f"call_{i}", "type": "function"}
        call["function"] = {"name": name, "arguments": json.dumps(args)}
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        messages.append({"role": "tool", "tool_call_id": f"call_{i}", "content": result})
        conversations.append([dict(m) for m in messages])
    return conversations


def _prose_task() -> list[list[dict[str, Any]]]:
    ask = "Write an essay about the history of lighthouses and the people who kept them."
    return [[{"role": "user", "content": ask}]]


def _prompts(tokenizer: Any, gen_len: int) -> dict[str, list[list[int]]]:
    rng = random.Random(0)
    tasks = {
        "edit": _edit_task(rng, gen_len),
        "agent": _agent_task(rng),
        "prose": _prose_task(),
    }
    prompts: dict[str, list[list[int]]] = {}
    for task, conversations in tasks.items():
        tools = TOOLS if task == "agent" else None
        texts = [
            tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
            for messages in conversations
        ]
        prompts[task] = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return prompts


def _run(
    engine: EngineCore, prompts: list[list[int]], gen_len: int
) -> tuple[int, float, int, list]:
    """Generate for each prompt in turn; (tokens, decode seconds, decode steps, outputs)."""
    tokens, seconds, steps, outputs = 0, 0.0, 0, []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, SamplingParams(temperature=0.0, max_tokens=gen_len))
        out: list[int] = []
        first = None
        while engine.has_work():
            deltas = engine.step()
            steps += first is not None
            for delta in deltas:
                if first is None and delta.new_token_ids:
                    first = time.perf_counter()
                out.extend(delta.new_token_ids)
        assert first is not None
        seconds += time.perf_counter() - first
        tokens += len(out) - 1
        outputs.append(out)
    return tokens, seconds, steps, outputs


def _accepted(engine: EngineCore) -> tuple[int, int]:
    s = engine.snapshot()
    return sum(s.spec_drafted_tokens.values()), sum(s.spec_accepted_tokens.values())


def run_spec_bench(
    model: str, dtype: str, gen_len: int, speculation: str = "auto", repeats: int = 3
) -> dict[str, Any]:
    tokenizer = load_tokenizer(resolve_model(model))
    if tokenizer is None:
        raise SystemExit("kamado bench --spec needs a model with a tokenizer")
    engines = {
        mode: EngineCore(EngineConfig(model=model, dtype=dtype, speculation=mode))
        for mode in ("off", speculation)
    }
    prompts = _prompts(tokenizer, gen_len)
    runs: list[SpecRun] = []
    for repeat in range(repeats):
        for task, task_prompts in prompts.items():
            for mode, engine in engines.items():
                before = _accepted(engine)
                tokens, seconds, steps, outputs = _run(engine, task_prompts, gen_len)
                after = _accepted(engine)
                run = SpecRun(
                    task, mode, repeat, tokens, seconds, tokens / seconds, steps,
                    tokens / steps, after[0] - before[0], after[1] - before[1], outputs,
                )  # fmt: skip
                runs.append(run)
                print(
                    f"{task:5s} r{repeat} {mode:5s}: {run.decode_tok_s:6.1f} tok/s over "
                    f"{tokens} tokens in {steps} steps, accepted {run.accepted}/{run.drafted}",
                    flush=True,
                )
    ties = _first_differences(engines["off"], prompts, runs, speculation)
    summary = _summary(runs, speculation, ties)
    return {
        "model": model,
        "dtype": dtype,
        "gen_len": gen_len,
        "speculation": speculation,
        "summary": summary,
        "runs": [asdict(r) for r in runs],
    }


def _first_differences(
    off: EngineCore,
    prompts: dict[str, list[list[int]]],
    runs: list[SpecRun],
    speculation: str,
) -> dict[str, list[dict[str, Any]]]:
    """Per task, where an output with speculation first differs from the one without, and
    whether the off engine's two best tokens there tie (a rounding tie, not a wrong token)."""
    found: dict[str, list[dict[str, Any]]] = {}
    for on_run in (r for r in runs if r.speculation == speculation):
        off_run = next(
            r
            for r in runs
            if (r.task, r.repeat, r.speculation) == (on_run.task, on_run.repeat, "off")
        )
        for prompt, a, b in zip(prompts[on_run.task], on_run.outputs, off_run.outputs, strict=True):
            at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if at is None:
                continue
            off.add_request(
                "tie", prompt + b[:at], SamplingParams(temperature=0.0, max_tokens=1, logprobs=2)
            )
            top: list[tuple[int, float]] = []
            while off.has_work():
                for delta in off.step():
                    if delta.logprobs:
                        top = delta.logprobs[0].top
            best = [t for t, lp in top if lp == top[0][1]]
            found.setdefault(on_run.task, []).append(
                {
                    "repeat": on_run.repeat,
                    "position": at,
                    "on_token": a[at],
                    "off_token": b[at],
                    "off_top": top,
                    "tie": a[at] in best and b[at] in best,
                }
            )
    return found


def _summary(
    runs: list[SpecRun], speculation: str, differences: dict[str, list[dict[str, Any]]]
) -> dict[str, Any]:
    print("\nspeculation on / off, decode tok/s (median over repeats):")
    summary = {}
    for task, target in TARGETS.items():
        on = [r for r in runs if r.task == task and r.speculation == speculation]
        off = [r for r in runs if r.task == task and r.speculation == "off"]
        ratios = [a.decode_tok_s / b.decode_tok_s for a, b in zip(on, off, strict=True)]
        drafted = sum(r.drafted for r in on)
        accepted = sum(r.accepted for r in on)
        summary[task] = {
            "speedup_median": statistics.median(ratios),
            "speedups": ratios,
            "on_tok_s_median": statistics.median(r.decode_tok_s for r in on),
            "off_tok_s_median": statistics.median(r.decode_tok_s for r in off),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            # Seconds per step on / off: what verification costs here, load drift included.
            "step_cost_ratio": statistics.median(
                (a.decode_s / a.decode_steps) / (b.decode_s / b.decode_steps)
                for a, b in zip(on, off, strict=True)
            ),
            "tokens_per_step": sum(r.tokens for r in on) / sum(r.decode_steps for r in on),
            "accepted_per_token": accepted / sum(r.tokens for r in on),
            "identical_outputs": all(a.outputs == b.outputs for a, b in zip(on, off, strict=True)),
            "first_differences": differences.get(task, []),
            "differences_all_ties": all(d["tie"] for d in differences.get(task, [])),
            "target": target,
        }
        s = summary[task]
        print(
            f"  {task:5s}: {s['speedup_median']:.2f}x (target >= {target}), "
            f"{s['tokens_per_step']:.2f} tokens/step at {s['step_cost_ratio']:.2f}x the step "
            f"time, acceptance {s['acceptance_rate']:.2f}, identical: {s['identical_outputs']}"
            + (
                ""
                if s["identical_outputs"]
                else f" (first differences at rounding ties: {s['differences_all_ties']})"
            )
        )
    return summary
