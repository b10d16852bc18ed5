"""Decode steps launched before the previous step's tokens are read (overlap_decode) give
the tokens of one step at a time, stop where they should and leak no blocks.

On CPU the launched step runs at once, so nothing overlaps in time, but the engine takes
the same path as on a GPU: inputs fed from the step in flight, tokens read a step late.
"""

from __future__ import annotations

import pytest

from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams
from tests.engine.conftest import greedy, make_engine, run
from tests.spec.test_controller import controller_with_cost

PROMPTS = {f"r{i}": [7 + i, 30 + 3 * i, 2, 91, 5 + i] * (1 + i) for i in range(4)}


def decode_all(engine: EngineCore, requests: dict, arrivals: dict | None = None) -> dict:
    """Run to completion, adding `arrivals` ({step: {request_id: (prompt, params)}}) as
    the step count reaches them."""
    out = {}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    step = 0
    while engine.has_work() or (arrivals and max(arrivals) >= step):
        for request_id, (prompt, params) in (arrivals or {}).get(step, {}).items():
            engine.add_request(request_id, prompt, params)
        for delta in engine.step():
            out.setdefault(delta.request_id, []).extend(delta.new_token_ids)
        step += 1
    return out


@pytest.mark.parametrize(
    "options",
    # Pacing off: the schedule (and so the preemption) does not depend on step timings.
    [{}, {"kv_cache_bytes": 16 * 4096, "block_size": 4, "decode_stall_factor": float("inf")}],
    ids=["roomy", "preempted"],
)
def test_overlapped_decode_gives_the_tokens_of_one_step_at_a_time(tiny_models, options):
    path, _ = tiny_models["qwen3"]
    plain = run(make_engine(path, speculation="off"), {"probe": (PROMPTS["r0"], greedy(40))})
    stop_token = plain["probe"][0][12]  # ends r0 at its 13th token, by a token, not a length
    requests = {
        "r0": (PROMPTS["r0"], greedy(40, stop_token_ids=[stop_token])),
        "r1": (PROMPTS["r1"], greedy(9)),
        "r2": (PROMPTS["r2"], greedy(25)),
    }
    arrivals = {6: {"r3": (PROMPTS["r3"], greedy(17))}}  # joins while the others decode
    results = {}
    for overlap in (False, True):
        engine = make_engine(path, speculation="off", overlap_decode=overlap, **options)
        results[overlap] = decode_all(engine, requests, arrivals)
        assert engine.pool.num_used == 0  # every block came back
        launched_ahead = engine.stats.steps_launched_ahead
        assert launched_ahead > 10 if overlap else launched_ahead == 0
        if options:
            assert engine.scheduler.num_preemptions > 0
    assert results[True] == results[False]
    assert results[True]["r0"][-1] == stop_token and len(results[True]["r0"]) <= 13
    assert [len(results[True][r]) for r in ("r1", "r2", "r3")] == [9, 25, 17]


def test_an_aborted_sequence_gets_no_token_from_the_step_in_flight(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, speculation="off", overlap_decode=True)
    engine.add_request("a", PROMPTS["r1"], greedy(50))
    engine.add_request("b", PROMPTS["r2"], greedy(20))
    got: dict[str, list[int]] = {"a": [], "b": []}
    while engine.has_work():
        for delta in engine.step():
            got[delta.request_id].extend(delta.new_token_ids)
            if delta.request_id == "a" and len(got["a"]) == 5:
                engine.abort("a")  # as a stop string would; a step for it is in flight
    assert len(got["a"]) == 5 and len(got["b"]) == 20
    alone = run(make_engine(path, speculation="off"), {"b": (PROMPTS["r2"], greedy(20))})
    assert got["b"] == alone["b"][0]
    assert engine.pool.num_used == 0


def test_blocks_filled_by_overlapped_steps_are_cached_with_the_right_tokens(tiny_models):
    path, _ = tiny_models["qwen2"]
    engine = make_engine(path, speculation="off", overlap_decode=True, block_size=4)
    first = run(engine, {"turn1": (PROMPTS["r3"], greedy(30))})["turn1"][0]
    # The next turn repeats the first turn's prompt and output: its prefix comes from the
    # cache, and decoding on from it gives what decoding straight through gave.
    history = PROMPTS["r3"] + first[:20]
    second = run(engine, {"turn2": (history, greedy(10))})["turn2"][0]
    assert engine.snapshot().prefix_device_hit_tokens >= len(history) - 4
    assert second == first[20:30]


def test_no_step_is_launched_ahead_where_the_next_one_needs_the_host(tiny_models):
    # Sampling and logprobs happen on the host: the next step's input is not on the device.
    path, _ = tiny_models["qwen3"]
    sampled = SamplingParams(temperature=0.8, seed=1, max_tokens=12, ignore_eos=True)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    for params in (sampled, with_logprobs):
        engine = make_engine(path, speculation="off", overlap_decode=True)
        run(engine, {"x": (PROMPTS["r0"], params)})
        assert engine.stats.steps_launched_ahead == 0


def test_speculation_beside_overlapped_decode_keeps_the_tokens(tiny_models):
    # The tiny model repeats itself, so drafts pay and most steps wait for the tokens to
    # plan from; the output must be the same either way (see tests/spec/test_plan_none.py).
    path, _ = tiny_models["qwen3"]
    requests = {r: (prompt, greedy(40)) for r, prompt in PROMPTS.items()}
    plain = run(make_engine(path, speculation="off"), requests)
    engine = make_engine(path, speculation="auto", overlap_decode=True)
    assert run(engine, requests) == plain
    assert engine.snapshot().spec_accepted_tokens


def test_steps_planned_ahead_score_the_proposers_as_steps_planned_from_tokens(tiny_models):
    # Verification costing ten plain steps: the controller verifies no draft, so steps go
    # ahead, and the proposers' drafts (asked once each step's input is in) are scored
    # exactly as without overlap.
    path, _ = tiny_models["qwen3"]
    requests = {r: (prompt, greedy(40)) for r, prompt in PROMPTS.items()}
    plain = run(make_engine(path, speculation="off"), requests)
    rates = {}
    for overlap in (False, True):
        engine = make_engine(path, speculation="auto", overlap_decode=overlap)
        assert engine.speculator is not None
        engine.speculator.controller = controller_with_cost(0.02, 0.001, extra=0.2)
        assert run(engine, requests) == plain
        rates[overlap] = engine.speculator.controller.global_rates
        assert (engine.stats.steps_launched_ahead > 30) == overlap
    assert rates[True] == rates[False] and rates[True]
