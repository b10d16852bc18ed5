"""Agent traces: the generator writes growing sessions; the JSONL format round-trips."""

import json

import pytest

from kamado.bench.replay import TurnResult, summarize
from kamado.bench.trace import generate_trace, read_trace, write_trace


def test_each_turn_resends_the_last_one_and_adds_a_tool_round(tmp_path):
    turns = generate_trace(agents=3, max_context_tokens=4000, new_tokens_per_turn=500, seed=4)
    path = tmp_path / "t.jsonl"
    write_trace(path, turns)
    assert read_trace(path) == turns
    by_agent: dict[str, list] = {}
    for t in turns:
        by_agent.setdefault(t.agent, []).append(t)
    assert len(by_agent) == 3
    for mine in by_agent.values():
        assert [t.turn for t in mine] == list(range(len(mine))) and len(mine) >= 5
        for prev, nxt in zip(mine, mine[1:], strict=False):
            before, after = prev.request["messages"], nxt.request["messages"]
            assert after[: len(before)] == before  # history is resent unchanged
            assert [m["role"] for m in after[len(before) :]] == ["assistant", "tool"]
            assert len(after[-1]["content"]) > 1000
        assert all(t.request["tools"] and t.request["prompt_cache_key"] for t in mine)
    # Agents differ after the shared system prompt and tools.
    firsts = [mine[1].request["messages"][-1]["content"] for mine in by_agent.values()]
    assert len(set(firsts)) == 3


def test_a_bad_line_is_reported_with_its_number(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"agent": "a", "turn": 0, "delay_s": 0, "request": {}}) + "\n{}\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_trace(path)


def test_summary_counts_hits_over_prompt_tokens_and_errors():
    usage = {"completion_tokens": 4, "usage_reported": True}
    results = [
        TurnResult("a", 0, 1.0, 2.0, prompt_tokens=100, cached_tokens=0, **usage),
        TurnResult("a", 1, 0.2, 1.0, prompt_tokens=200, cached_tokens=180, **usage),
        TurnResult("b", 1, None, 0.1, error="HTTP 500"),
    ]
    s = summarize(results, wall_s=10.0)
    assert s["errors"] == 1 and s["turns"] == 3
    assert s["prefix_hit_rate"] == pytest.approx(180 / 300)
    assert s["prefix_hit_rate_follow_ups"] == pytest.approx(0.9)
    assert s["ttft_follow_ups"]["median_s"] == 0.2
    assert s["turns_per_hour"] == pytest.approx(2 * 360)
    assert s["generated_tokens_per_s"] == pytest.approx(0.8)
    assert s["turn_time"]["median_s"] == 1.5


def test_a_larger_system_prompt_is_shared_by_every_agent():
    small = generate_trace(agents=2, max_context_tokens=8000, new_tokens_per_turn=500, seed=3)
    big = generate_trace(
        agents=2, max_context_tokens=8000, new_tokens_per_turn=500, seed=3, system_tokens=5000
    )
    systems = {t.request["messages"][0]["content"] for t in big}
    assert len(systems) == 1  # one agent program: every agent and turn sends the same one
    grown = len(systems.pop())
    assert 5000 * 3 < grown < 5000 * 4 and grown > 3 * len(
        small[0].request["messages"][0]["content"]
    )
    assert len(big) < len(small)  # the context fills sooner
