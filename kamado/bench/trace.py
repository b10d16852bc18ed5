"""Agent traces: the JSONL format `kamado replay` reads, and a generator of synthetic
coding-agent sessions in that format.

One JSON object per line, one chat request each:

    {"agent": "agent-0", "turn": 0, "delay_s": 0.0, "request": {...}}

`request` is an OpenAI chat completions body (messages, tools, max_tokens, ...). An agent's
requests are sent one after another, in `turn` order: each `delay_s` seconds after the
agent's previous reply ended (the first one, after the replay started). Agents run side by
side. A captured trace converts to this format by keeping each request body and taking
`delay_s` as the gap between a reply and the agent's next request.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 3.3  # Python source under BPE tokenizers (Qwen2.5: ~3.2-3.4)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": d} for p, d in params},
                "required": [p for p, _ in params],
            },
        },
    }
    for name, description, params in (
        ("read_file", "Read a file of the repository.", [("path", "path from the repo root")]),
        (
            "write_file",
            "Replace a file's content.",
            [("path", "path from the repo root"), ("content", "the new content")],
        ),
        ("bash", "Run a shell command in the repository.", [("command", "the command")]),
        ("grep", "Search the repository for a regex.", [("pattern", "a Python regex")]),
    )
]

SYSTEM = (
    "You are a coding agent working in a Python repository. Use the tools to read files, "
    "run tests and edit code. Make the smallest change that fixes the task, keep the style "
    "of the surrounding code, and run the tests before you finish. Reply with one tool call "
    "at a time. When the task is done, answer with a short summary of what you changed. "
) * 3

WORDS = [
    "cache",
    "block",
    "token",
    "request",
    "session",
    "engine",
    "queue",
    "batch",
    "buffer",
    "stream",
    "parser",
    "config",
    "handler",
    "record",
    "index",
    "window",
    "budget",
    "layer",
    "tensor",
    "shard",
    "worker",
    "result",
    "status",
    "limit",
    "offset",
    "cursor",
    "payload",
    "header",
    "entry",
    "table",
    "schema",
    "commit",
    "branch",
]


@dataclass
class TraceTurn:
    agent: str
    turn: int
    delay_s: float
    request: dict[str, Any]


def read_trace(path: str | Path) -> list[TraceTurn]:
    turns = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                turns.append(TraceTurn(**json.loads(line)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{n}: not a trace record ({e})") from None
    return turns


def write_trace(path: str | Path, turns: list[TraceTurn]) -> None:
    Path(path).write_text("".join(json.dumps(asdict(t)) + "\n" for t in turns))


def _source_file(rng: random.Random, approx_tokens: int) -> str:
    """Plausible Python of about `approx_tokens` tokens, different for every call."""
    lines: list[str] = ['"""' + " ".join(rng.choices(WORDS, k=12)) + '."""', ""]
    while len("\n".join(lines)) < approx_tokens * CHARS_PER_TOKEN:
        a, b, c = rng.sample(WORDS, 3)
        lines += [
            f"def {a}_{b}_{rng.randrange(1000)}({c}, limit={rng.randrange(2, 512)}):",
            f'    """Return the {b} of {c} within limit."""',
            f"    {a} = [x for x in {c} if x.{b} < limit]",
            f"    if not {a}:",
            f"        raise ValueError('no {b} in {c}')",
            f"    return sorted({a}, key=lambda x: x.{rng.choice(WORDS)})[:{rng.randrange(1, 64)}]",
            "",
        ]
    return "\n".join(lines)


def _system_prompt(approx_tokens: int, seed: int) -> str:
    """The agent program's instructions, grown to about `approx_tokens` with the kind of
    project context agents put there (OpenCode's system prompt and tool schemas come to
    ~6,900 tokens, ../shared/CLIENTS.md): a listing of the repository's files."""
    rng = random.Random(seed)
    lines = [SYSTEM, "", "# Repository files"]
    while len("\n".join(lines)) < approx_tokens * CHARS_PER_TOKEN:
        a, b, c = rng.sample(WORDS, 3)
        lines.append(f"- src/{a}/{b}_{c}.py: the {b} {c} of the {a} layer")
    return "\n".join(lines)


def generate_trace(
    agents: int = 4,
    max_context_tokens: int = 8192,
    new_tokens_per_turn: int = 1000,
    max_tokens: int = 16,
    think_s: float = 0.5,
    seed: int = 0,
    system_tokens: int = 0,
) -> list[TraceTurn]:
    """Coding-agent sessions: one task each, then turns that read a file (a tool call and its
    result of ~`new_tokens_per_turn` tokens) until the context nears `max_context_tokens`.
    Agents share the system prompt and tools, as instances of one agent program do; with
    `system_tokens` the system prompt carries project context up to about that size."""
    rng = random.Random(seed)
    system = _system_prompt(system_tokens, seed) if system_tokens else SYSTEM
    turns: list[TraceTurn] = []
    for a in range(agents):
        agent = f"agent-{a}"
        task = (
            f"Working directory: /work/project-{a}. Task: the {rng.choice(WORDS)} "
            f"{rng.choice(WORDS)} test fails intermittently; find the cause and fix it."
        )
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": task},
        ]
        context = (len(system) + len(task) + len(json.dumps(TOOLS))) / CHARS_PER_TOKEN
        turn = 0
        while True:
            request = {
                "messages": [dict(m) for m in messages],
                "tools": TOOLS,
                "max_tokens": max_tokens,
                "temperature": 0,
                "prompt_cache_key": agent,
            }
            delay = a * think_s if turn == 0 else think_s * (0.5 + rng.random())
            turns.append(TraceTurn(agent, turn, round(delay, 3), request))
            if context + new_tokens_per_turn + max_tokens > max_context_tokens:
                break
            path = f"src/{rng.choice(WORDS)}_{rng.choice(WORDS)}.py"
            call_id = f"call_{a}_{turn}"
            messages.append(
                {
                    "role": "assistant",
                    # "" rather than null, which llama-cpp-python's server refuses (a peer
                    # in `replay compare`); Qwen's template renders both the same.
                    "content": "",
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {
                                "name": "read_file",
                                "arguments": json.dumps({"path": path}),
                            },
                        }
                    ],
                }
            )
            content = _source_file(rng, new_tokens_per_turn)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
            context += new_tokens_per_turn
            turn += 1
    return turns
