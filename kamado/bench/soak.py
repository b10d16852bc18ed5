"""`kamado replay run --soak DURATION`: replay agent traces in a loop for a long time and
watch that the server stays correct and flat.

Each agent replays its turns over and over; every pass is a fresh session (its system
prompt and cache key carry the pass number), as a new task of the same agent would be.
When the duration is up no new turn starts, and the turns in flight finish. Reported per
window of time: requests, errors, latency percentiles, tokens/s; sampled from the
server's /metrics all along: server and engine memory, KV blocks in use and cached,
requests in flight, engine restarts. The verdict compares memory after warm-up with
memory at the end, and checks that no KV block is held once the server is idle.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kamado.bench.replay import TurnResult, median_p99, seconds_text, send_turn, summarize
from kamado.bench.trace import TraceTurn

# Gauges sampled from /metrics, by the name they are reported under here.
SAMPLED = {
    "server_rss_bytes": "process_resident_memory_bytes",
    "engine_rss_bytes": "kamado_engine_resident_memory_bytes",
    "kv_blocks_used": "kamado_kv_blocks_used",
    "kv_blocks_cached": "kamado_kv_blocks_cached",
    "kv_blocks_total": "kamado_kv_blocks_total",
    "in_flight": "kamado_requests_in_flight",
    "engine_restarts": "kamado_engine_restarts_total",
}
WARMUP_SHARE = 0.2  # memory is judged flat against its level after this share of the run
FLAT_TOLERANCE = 0.10  # growth beyond warm-up level that still counts as flat


def parse_duration(text: str) -> float:
    """'90', '90s', '30m', '2h' -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    scale = units.get(text[-1:])
    number = text[:-1] if scale else text
    try:
        seconds = float(number) * (scale or 1)
    except ValueError:
        raise ValueError(f"not a duration: {text!r} (try 90s, 30m or 2h)") from None
    if seconds <= 0:
        raise ValueError(f"the duration must be positive, not {text!r}")
    return seconds


def as_new_session(turn: TraceTurn, n: int) -> TraceTurn:
    """The turn as pass `n` of its agent sends it: a session of its own, so the prefix
    cache sees a new task and its old sessions age out as they would overnight."""
    if n == 0:
        return turn
    request = dict(turn.request)
    messages = [dict(m) for m in request.get("messages", [])]
    if messages and isinstance(messages[0].get("content"), str):
        messages[0]["content"] = f"[task {n}] " + messages[0]["content"]
    request["messages"] = messages
    if "prompt_cache_key" in request:
        request["prompt_cache_key"] = f"{request['prompt_cache_key']}/task-{n}"
    return replace(turn, request=request)


@dataclass
class SoakResult:
    result: TurnResult
    finished_s: float  # since the soak began
    agent_pass: int


async def _scrape(client: httpx.AsyncClient, metrics_url: str) -> dict[str, float]:
    r = await client.get(metrics_url)
    r.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for sample in family.samples:
            values.setdefault(sample.name, sample.value)
    return {key: values[name] for key, name in SAMPLED.items() if name in values}


async def soak(
    url: str,
    turns: list[TraceTurn],
    duration_s: float,
    model: str = "",
    window_s: float = 60.0,
    sample_every_s: float = 5.0,
    timeout_s: float = 1800.0,
    progress: bool = True,
) -> dict[str, Any]:
    agents: dict[str, list[TraceTurn]] = {}
    for t in sorted(turns, key=lambda t: (t.agent, t.turn)):
        agents.setdefault(t.agent, []).append(t)
    metrics_url = url.rstrip("/").removesuffix("/v1") + "/metrics"
    results: list[SoakResult] = []
    samples: list[dict[str, float]] = []
    started = time.perf_counter()

    def elapsed() -> float:
        return time.perf_counter() - started

    async def run_agent(client: httpx.AsyncClient, mine: list[TraceTurn]) -> None:
        n = 0
        while elapsed() < duration_s:
            for t in mine:
                if elapsed() >= duration_s:
                    return
                await asyncio.sleep(t.delay_s)
                result = await send_turn(client, url, model, as_new_session(t, n))
                results.append(SoakResult(result, elapsed(), n))
            n += 1

    async def sample(client: httpx.AsyncClient) -> None:
        reported = 0
        while True:
            try:
                values = await _scrape(client, metrics_url)
            except (httpx.HTTPError, ValueError) as e:
                values = {"scrape_error": 1.0}
                if progress:
                    print(f"  metrics scrape failed: {e}", flush=True)
            samples.append({"t_s": elapsed(), **values})
            if progress and elapsed() // window_s > reported:
                reported = int(elapsed() // window_s)
                done = windows(results, window_s, samples)[reported - 1]
                print(format_window(done), flush=True)
            await asyncio.sleep(sample_every_s)

    timeout = httpx.Timeout(timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout) as client:
        sampler = asyncio.create_task(sample(client))
        await asyncio.gather(*(run_agent(client, mine) for mine in agents.values()))
        sampler.cancel()
        await asyncio.sleep(1.0)  # let the engine report its state once it is idle
        samples.append({"t_s": elapsed(), **await _scrape(client, metrics_url)})
    wall_s = elapsed()
    summary = summarize([r.result for r in results], wall_s)
    return {
        "duration_s": duration_s,
        "agents": len(agents),
        "summary": {k: v for k, v in summary.items() if k != "per_turn"},
        "windows": windows(results, window_s, samples),
        "samples": samples,
        "verdict": verdict(summary["errors"], samples, duration_s),
        "per_turn": [
            {**asdict(r.result), "finished_s": r.finished_s, "pass": r.agent_pass} for r in results
        ],
    }


def windows(
    results: list[SoakResult], window_s: float, samples: list[dict[str, float]]
) -> list[dict[str, Any]]:
    """Requests finished and the server's state, one entry per window of time."""
    end = max([r.finished_s for r in results] + [s["t_s"] for s in samples] + [0.0])
    out = []
    for i in range(int(end // window_s) + 1):
        lo, hi = i * window_s, (i + 1) * window_s
        mine = [r.result for r in results if lo <= r.finished_s < hi]
        ok = [r for r in mine if r.error is None]
        ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
        latency = [r.seconds for r in ok]
        state = [s for s in samples if lo <= s["t_s"] < hi and "scrape_error" not in s]

        def peak(key: str, state: list[dict[str, float]] = state) -> float | None:
            values = [s[key] for s in state if key in s]
            return max(values) if values else None

        out.append(
            {
                "start_s": lo,
                "requests": len(mine),
                "errors": len(mine) - len(ok),
                **{f"ttft_{k}": v for k, v in _p50_p99(ttft).items()},
                **{f"latency_{k}": v for k, v in _p50_p99(latency).items()},
                "generated_tokens_per_s": sum(r.completion_tokens for r in ok) / window_s,
                **{f"max_{key}": peak(key) for key in SAMPLED},
            }
        )
    return out


def verdict(errors: int, samples: list[dict[str, float]], duration_s: float) -> dict[str, Any]:
    """Flat means: memory at the end within FLAT_TOLERANCE of its level after warm-up, and
    no KV block held by a request once the server is idle (cached blocks may stay).

    Warm-up lasts WARMUP_SHARE of the run, or until the KV pool first filled if later: the
    pool's pages become resident as blocks are first written, which is growth that stops."""
    good = [s for s in samples if "scrape_error" not in s]
    full = [s["t_s"] for s in good if _pool_full(s)]
    warm_from = max([WARMUP_SHARE * duration_s, *full[:1]])
    settled = [s for s in good if s["t_s"] >= warm_from]
    out: dict[str, Any] = {
        "errors": errors,
        "scrape_errors": len(samples) - len(good),
        "kv_pool_filled_at_s": full[0] if full else None,
        "judged_from_s": warm_from,
    }
    for key in ("server_rss_bytes", "engine_rss_bytes"):
        values = [s[key] for s in settled if key in s]
        if len(values) < 2:
            out[f"{key}_growth"] = None
            continue
        quarter = max(1, len(values) // 4)
        after_warmup = statistics.median(values[:quarter])
        at_end = statistics.median(values[-quarter:])
        out[f"{key}_growth"] = (at_end - after_warmup) / after_warmup
    idle = good[-1] if good else {}
    out["kv_blocks_used_when_idle"] = idle.get("kv_blocks_used")
    out["engine_restarts"] = idle.get("engine_restarts")
    growths = [out["server_rss_bytes_growth"], out["engine_rss_bytes_growth"]]
    out["flat"] = all(g is not None and g <= FLAT_TOLERANCE for g in growths) and (
        out["kv_blocks_used_when_idle"] == 0
    )
    out["passed"] = (
        out["flat"] and errors == 0 and not out["scrape_errors"] and not out["engine_restarts"]
    )
    return out


def _p50_p99(values: list[float]) -> dict[str, float | None]:
    stats = median_p99(values)
    return {"p50_s": stats["median_s"], "p99_s": stats["p99_s"]}


def _pool_full(sample: dict[str, float]) -> bool:
    """Every block of the KV pool in use or cached (a block or two of slack allowed)."""
    total = sample.get("kv_blocks_total")
    held = sample.get("kv_blocks_used", 0) + sample.get("kv_blocks_cached", 0)
    return bool(total) and held >= total - 2


def format_window(w: dict[str, Any]) -> str:
    sec = seconds_text

    def mib(x: float | None) -> str:
        return "n/a" if x is None else f"{x / 2**20:.0f}MiB"

    return (
        f"[{w['start_s'] / 60:5.1f} min] {w['requests']} requests, {w['errors']} errors, "
        f"TTFT p50 {sec(w['ttft_p50_s'])} p99 {sec(w['ttft_p99_s'])}, "
        f"{w['generated_tokens_per_s']:.1f} tok/s, "
        f"RSS server {mib(w['max_server_rss_bytes'])} engine {mib(w['max_engine_rss_bytes'])}, "
        f"KV used {w['max_kv_blocks_used']} cached {w['max_kv_blocks_cached']}"
    )


def format_verdict(v: dict[str, Any]) -> str:
    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:+.1f}%"

    return (
        f"soak {'PASSED' if v['passed'] else 'FAILED'}: {v['errors']} errors, "
        f"{v['scrape_errors']} failed metric scrapes, engine restarts {v['engine_restarts']}; "
        f"RSS after warm-up to end: server {pct(v['server_rss_bytes_growth'])}, "
        f"engine {pct(v['engine_rss_bytes_growth'])}; "
        f"KV blocks held when idle: {v['kv_blocks_used_when_idle']}"
    )
