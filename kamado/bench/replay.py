"""`kamado replay`: replay an agent trace against any OpenAI-compatible server.

Each agent's turns go out one after another (streamed, with usage); agents run side by
side. Reported: prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens over
prompt tokens), time to first token as the client sees it (first content or tool-call
delta) for all turns and for follow-up turns, each turn's time from request to the end of
its reply, generated tokens per second, completed turns per hour, and errors. A server
that leaves out cached_tokens (or usage in streams) gets "not reported", never a zero it
did not say.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from kamado.bench.trace import TraceTurn


@dataclass
class TurnResult:
    agent: str
    turn: int
    ttft_s: float | None
    seconds: float
    prompt_tokens: int = 0
    cached_tokens: int | None = None  # None: the server's usage did not say
    completion_tokens: int = 0
    usage_reported: bool = False
    content_chunks: int = 0  # stream chunks carrying text or tool-call deltas
    error: str | None = None


async def send_turn(client: httpx.AsyncClient, url: str, model: str, turn: TraceTurn) -> TurnResult:
    body = {**turn.request, "stream": True, "stream_options": {"include_usage": True}}
    body.setdefault("model", model)
    started = time.perf_counter()
    result = TurnResult(turn.agent, turn.turn, None, 0.0)
    try:
        async with client.stream("POST", url + "/chat/completions", json=body) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                await _read_stream(r, result, started)
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - started
    return result


async def _read_stream(r: httpx.Response, result: TurnResult, started: float) -> None:
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            result.error = str(chunk["error"].get("message", chunk["error"]))[:200]
            return
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("tool_calls"):
                result.content_chunks += 1
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
        if usage := chunk.get("usage"):
            result.usage_reported = True
            result.prompt_tokens = usage.get("prompt_tokens", 0)
            details = usage.get("prompt_tokens_details") or {}
            result.cached_tokens = details.get("cached_tokens")
            result.completion_tokens = usage.get("completion_tokens", 0)
    result.error = "the stream ended without [DONE]"


async def replay(
    url: str, turns: list[TraceTurn], model: str = "", timeout_s: float = 1800.0
) -> dict[str, Any]:
    agents: dict[str, list[TraceTurn]] = {}
    for t in sorted(turns, key=lambda t: (t.agent, t.turn)):
        agents.setdefault(t.agent, []).append(t)
    results: list[TurnResult] = []

    async def run_agent(client: httpx.AsyncClient, mine: list[TraceTurn]) -> None:
        for t in mine:
            await asyncio.sleep(t.delay_s)
            results.append(await send_turn(client, url, model, t))

    started = time.perf_counter()
    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        await asyncio.gather(*(run_agent(client, mine) for mine in agents.values()))
    return summarize(results, time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median_p99(values: list[float]) -> dict[str, float | None]:
    """The median and 99th percentile of latencies in seconds (None where there are none)."""
    return {
        "median_s": statistics.median(values) if values else None,
        "p99_s": percentile(values, 0.99),
    }


def seconds_text(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}s"


def summarize(results: list[TurnResult], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    follow_ups = [r for r in ok if r.turn > 0]

    def hit_rate(rs: list[TurnResult]) -> float | None:
        reported = [r for r in rs if r.cached_tokens is not None]
        prompt = sum(r.prompt_tokens for r in reported)
        return sum(r.cached_tokens or 0 for r in reported) / prompt if prompt else None

    def ttft(rs: list[TurnResult]) -> dict[str, float | None]:
        return median_p99([r.ttft_s for r in rs if r.ttft_s is not None])

    # Without usage in the stream, generated tokens are counted as the chunks that carried
    # text (servers that stream one token a chunk, as llama-cpp-python does).
    by_usage = all(r.usage_reported for r in ok)
    generated = sum(r.completion_tokens if by_usage else r.content_chunks for r in ok)
    return {
        "turns": len(results),
        "errors": len(results) - len(ok),
        "wall_s": wall_s,
        "cached_tokens_reported": any(r.cached_tokens is not None for r in ok),
        "prefix_hit_rate": hit_rate(ok),
        "prefix_hit_rate_follow_ups": hit_rate(follow_ups),
        "ttft": ttft(ok),
        "ttft_follow_ups": ttft(follow_ups),
        # Request to last byte: comparable where servers stream differently (kamado holds
        # a reply that may be a tool call until it parses; a raw-text stream does not).
        "turn_time": median_p99([r.seconds for r in ok]),
        "prompt_tokens": sum(r.prompt_tokens for r in ok) if by_usage else None,
        "generated_tokens_counted_from": "usage" if by_usage else "stream chunks",
        "generated_tokens_per_s": generated / wall_s,
        "turns_per_hour": len(ok) * 3600 / wall_s,
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "per_turn": [asdict(r) for r in sorted(results, key=lambda r: (r.agent, r.turn))],
    }


def _rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    def hits(x: float | None) -> str:
        if not s["cached_tokens_reported"]:
            return "not reported"
        return "n/a" if x is None else f"{100 * x:.1f}%"

    sec = seconds_text
    tokens_note = "" if s["generated_tokens_counted_from"] == "usage" else " (stream chunks)"
    return [
        ("turns", str(s["turns"])),
        ("errors", str(s["errors"])),
        ("wall", f"{s['wall_s']:.0f}s"),
        ("prefix hit rate, all turns", hits(s["prefix_hit_rate"])),
        ("prefix hit rate, follow-ups", hits(s["prefix_hit_rate_follow_ups"])),
        ("TTFT median, all turns", sec(s["ttft"]["median_s"])),
        ("TTFT p99, all turns", sec(s["ttft"]["p99_s"])),
        ("TTFT median, follow-ups", sec(s["ttft_follow_ups"]["median_s"])),
        ("TTFT p99, follow-ups", sec(s["ttft_follow_ups"]["p99_s"])),
        ("turn time median", sec(s["turn_time"]["median_s"])),
        ("turn time p99", sec(s["turn_time"]["p99_s"])),
        ("generated tokens/s", f"{s['generated_tokens_per_s']:.1f}{tokens_note}"),
        ("turns/hour", f"{s['turns_per_hour']:.0f}"),
    ]


def format_table(summaries: dict[str, dict[str, Any]]) -> str:
    """Replay summaries side by side, one column per server (or configuration)."""
    columns = [_rows(s) for s in summaries.values()]
    table = [["", *summaries]]
    table += [[label, *(col[i][1] for col in columns)] for i, (label, _) in enumerate(columns[0])]
    widths = [max(len(row[c]) for row in table) for c in range(len(table[0]))]
    lines = []
    for row in table:
        cells = (f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True))
        lines.append("  ".join([row[0].ljust(widths[0]), *cells]))
    return "\n".join(lines)
