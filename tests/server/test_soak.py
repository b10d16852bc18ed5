"""`kamado replay run --soak`: agents loop over their turns; the report tracks the server."""

import asyncio

import pytest

from kamado.bench.soak import as_new_session, parse_duration, soak, verdict
from kamado.bench.trace import generate_trace
from tests.server.conftest import start_server


@pytest.fixture(scope="module")
def server(qwen05_path):
    # Room for the trace's system prompt and tool definitions (~700 tokens) and a few turns.
    yield from start_server(qwen05_path, "--max-model-len", "1536")


def test_durations_parse_and_bad_ones_say_how_to_write_them():
    assert [parse_duration(t) for t in ("90", "90s", "30m", "2h", "1.5m")] == [
        90,
        90,
        1800,
        7200,
        90,
    ]
    for bad in ("", "soon", "-5m", "0"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(bad)


def test_each_pass_is_a_new_session_with_a_different_prompt():
    turn = generate_trace(agents=1, max_context_tokens=1000, new_tokens_per_turn=80, seed=1)[1]
    again = as_new_session(turn, 3)
    assert as_new_session(turn, 0) == turn
    assert again.request["prompt_cache_key"] != turn.request["prompt_cache_key"]
    assert again.request["messages"][0]["content"].startswith("[task 3] ")
    assert again.request["messages"][1:] == turn.request["messages"][1:]
    assert not turn.request["messages"][0]["content"].startswith("[task")  # not mutated


def _sample(t: float, rss: float, used: int = 0, cached: int = 0) -> dict[str, float]:
    return {
        "t_s": t,
        "server_rss_bytes": 100.0,
        "engine_rss_bytes": rss,
        "kv_blocks_used": used,
        "kv_blocks_cached": cached,
        "kv_blocks_total": 10,
    }


def test_memory_is_judged_from_when_the_kv_pool_filled():
    # The engine grows while its pool's pages are first touched (until t=50), then holds.
    filling = [_sample(t, 1000 + 20 * t, used=2, cached=t // 10) for t in range(0, 50, 5)]
    settled = [_sample(t, 2000, used=3, cached=7) for t in range(50, 100, 5)]
    v = verdict(0, [*filling, *settled, _sample(101, 2000, used=0, cached=10)], 100)
    assert v["kv_pool_filled_at_s"] == 50 and v["judged_from_s"] == 50
    assert v["engine_rss_bytes_growth"] == 0 and v["passed"]
    # Growth after the pool is full is a leak.
    leaking = [_sample(t, 2000 + 10 * t, used=3, cached=7) for t in range(50, 100, 5)]
    v = verdict(0, [*filling, *leaking, _sample(101, 3000, used=0, cached=10)], 100)
    assert v["engine_rss_bytes_growth"] > 0.1 and not v["flat"] and not v["passed"]
    # A block still held by a request after the run, or an error, fails it too.
    v = verdict(0, [*filling, *settled, _sample(101, 2000, used=1, cached=9)], 100)
    assert v["kv_blocks_used_when_idle"] == 1 and not v["passed"]
    assert not verdict(1, [*filling, *settled, _sample(101, 2000)], 100)["passed"]


def test_a_short_soak_against_a_real_server(server):
    turns = generate_trace(
        agents=2, max_context_tokens=750, new_tokens_per_turn=60, max_tokens=3, seed=2
    )
    url = server.url + "/v1"
    out = asyncio.run(soak(url, turns, duration_s=25, window_s=5, sample_every_s=1, progress=False))
    assert out["summary"]["errors"] == 0
    assert max(r["pass"] for r in out["per_turn"]) >= 1  # the agents looped
    assert sum(w["requests"] for w in out["windows"]) == out["summary"]["turns"]
    samples = out["samples"]
    assert len(samples) >= 10 and all(s["engine_rss_bytes"] > 0 for s in samples)
    assert all(s["server_rss_bytes"] > 0 for s in samples)
    v = out["verdict"]
    assert v["errors"] == 0 and v["scrape_errors"] == 0 and v["engine_restarts"] == 0
    assert v["kv_blocks_used_when_idle"] == 0
    assert samples[-1]["in_flight"] == 0
