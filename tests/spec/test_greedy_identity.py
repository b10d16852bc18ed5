"""Greedy output is token for token the same with speculation on and off, for every
proposer, in batches, with chunked prefill, preemption, stop tokens, n > 1 and prefix reuse."""

import random

import pytest

from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import greedy, make_engine, run

PROPOSERS = ["ngram", "suffix", "auto"]


def repetitive_requests() -> dict:
    """Prompts that repeat a stretch of tokens, as agents repeat file contents."""
    rng = random.Random(3)
    requests = {}
    for i in range(6):
        body = [rng.randrange(3, 512) for _ in range(rng.randrange(8, 20))]
        prompt = body + [rng.randrange(3, 512)] + body[: rng.randrange(2, 6)]
        requests[f"r{i}"] = (prompt, greedy(rng.randrange(12, 33)))
    return requests


def speculating(path, **options):
    """An engine whose draft lengths do not follow this machine's step timings (the
    priors stay), nor its prefill beside decodes (unpaced: the pacer sizes chunks by
    measured steps), so its schedule, preemptions included, is the same on every run.
    A CI run on a machine losing CPU to other guests once got no preemption without it."""
    engine = make_engine(path, decode_stall_factor=float("inf"), **options)
    engine.speculator.controller.cost.observe = lambda *args: None
    return engine


def spec_stats(engine) -> tuple[int, int]:
    s = engine.snapshot()
    return sum(s.spec_drafted_tokens.values()), sum(s.spec_accepted_tokens.values())


@pytest.mark.parametrize("proposer", PROPOSERS)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},
        {"kv_cache_bytes": 16 * 4096, "block_size": 4},
        {"kv_cache_bytes": 16 * 4096, "block_size": 4, "max_num_batched_tokens": 16},
    ],
    ids=["batched", "chunked", "preempted", "chunked+preempted"],
)
def test_greedy_tokens_are_the_same_with_speculation(tiny_models, proposer, options):
    path, _ = tiny_models["qwen3"]
    requests = repetitive_requests()
    off = run(make_engine(path, speculation="off", **options), requests)
    engine = speculating(path, speculation=proposer, **options)
    on = run(engine, requests)
    assert on == off
    drafted, accepted = spec_stats(engine)
    assert accepted > 0 and drafted >= accepted  # drafts really were verified and kept
    if "kv_cache_bytes" in options:
        assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_used == 0  # blocks taken for drafts came back


def test_a_stop_token_inside_an_accepted_draft_stops_there(tiny_models):
    path, _ = tiny_models["qwen3"]
    requests = repetitive_requests()
    off = run(make_engine(path, speculation="off"), requests)
    # Stop each request at a token from the middle of its own output.
    stopping = {
        rid: (
            prompt,
            greedy(params.max_tokens, stop_token_ids=[off[rid][0][len(off[rid][0]) // 2]]),
        )
        for rid, (prompt, params) in requests.items()
    }
    expected = run(make_engine(path, speculation="off"), stopping)
    engine = speculating(path, speculation="auto")
    assert run(engine, stopping) == expected
    assert spec_stats(engine)[1] > 0


def test_n_choices_and_seeded_sampling_beside_greedy_are_unchanged(tiny_models):
    path, _ = tiny_models["qwen2"]
    requests = repetitive_requests()
    prompt = requests["r0"][0]
    requests["n"] = (prompt, SamplingParams(n=3, temperature=0.7, seed=9, max_tokens=20))
    requests["pen"] = (
        prompt,
        SamplingParams(temperature=0.5, seed=2, max_tokens=20, frequency_penalty=0.8, logprobs=2),
    )
    off = run(make_engine(path, speculation="off"), requests)
    engine = speculating(path, speculation="auto")
    assert run(engine, requests) == off
    assert spec_stats(engine)[1] > 0


def test_blocks_committed_under_speculation_hold_the_accepted_tokens(tiny_models):
    """A later request reuses the cached prefix a speculating request left behind, and
    continues exactly as an engine that computed everything itself."""
    path, _ = tiny_models["qwen3"]
    prompt, params = repetitive_requests()["r1"]
    engine = speculating(path, speculation="auto", block_size=4)
    first = run(engine, {"a": (prompt, params)})["a"][0]
    follow_up = prompt + first + prompt[:6]
    reused = run(engine, {"b": (follow_up, greedy(16))})["b"][0]
    assert engine.snapshot().prefix_device_hit_tokens >= len(prompt + first) - 4
    fresh = make_engine(path, speculation="off", enable_prefix_caching=False)
    assert reused == run(fresh, {"b": (follow_up, greedy(16))})["b"][0]
