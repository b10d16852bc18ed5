"""A request's tokens do not depend on what else runs beside it, or how it was scheduled."""

import random

import pytest

from kamado.engine.pacer import PrefillPacer
from kamado.engine.sampling_params import SamplingParams
from kamado.engine.scheduler import Scheduler
from kamado.engine.sequence import Sequence, Status
from kamado.kv.block_pool import BlockPool
from kamado.kv.prefix_cache import PrefixCache
from tests.engine.conftest import greedy, make_engine, run


def mixed_requests() -> dict:
    rng = random.Random(7)
    requests = {}
    for i in range(8):
        prompt = [rng.randrange(512) for _ in range(rng.randrange(3, 60))]
        params = greedy(rng.randrange(8, 30))
        if i % 3 == 1:  # seeded sampling must be just as stable as greedy
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20)
        requests[f"r{i}"] = (prompt, params)
    return requests


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 7},  # prompts arrive in chunks
        {"kv_cache_bytes": 24 * 4096, "block_size": 4},  # too small for all: preemption
        {"kv_cache_bytes": 24 * 4096, "block_size": 4, "max_num_batched_tokens": 16},
    ],
    ids=["batched", "chunked", "preempted", "chunked+preempted"],
)
def test_same_tokens_alone_and_in_a_mixed_batch(tiny_models, options):
    path, _ = tiny_models["qwen3"]
    # The pool sizes here preempt on the one-token-per-step schedule; tests/spec runs
    # these cases with speculation.
    options = {**options, "speculation": "off"}
    requests = mixed_requests()
    alone = {}
    for request_id, request in requests.items():
        alone.update(run(make_engine(path), {request_id: request}))
    engine = make_engine(path, **options)
    together = run(engine, requests)
    assert together == alone
    if "kv_cache_bytes" in options:
        assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_used == 0  # every block came back


def test_every_step_carries_every_decoding_sequence(tiny_models):
    path, _ = tiny_models["llama"]
    # Pacing off: even prefill at the full token budget never crowds out a decode.
    engine = make_engine(path, max_num_batched_tokens=16, decode_stall_factor=float("inf"))
    for i in range(3):
        engine.add_request(f"d{i}", [1 + i, 2, 3], greedy(200))
    for _ in range(3):
        engine.step()
    engine.add_request("long", list(range(1, 400)), greedy(4))
    prefill_steps = 0
    while True:
        decoded = {d.request_id for d in engine.step()}
        assert {"d0", "d1", "d2"} <= decoded  # no decode stream skipped a step
        prefill_steps += 1
        if "long" in decoded:
            break
    assert prefill_steps > 20  # the long prompt really was spread over many steps


def test_n_choices_share_the_prompt_kv(tiny_models):
    path, _ = tiny_models["qwen2"]
    engine = make_engine(path, block_size=4)
    prompt = list(range(5, 19))  # 14 tokens: 3 full blocks and a partial one
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    engine.add_request("n", prompt, params)
    engine.step()  # choice 0 prefills the prompt once; the others fork from it
    seqs = engine._requests["n"]
    assert all(s.block_table[:3] == seqs[0].block_table[:3] for s in seqs)
    assert engine.pool.ref_counts[seqs[0].block_table[0]] == 4
    assert len({s.block_table[3] for s in seqs}) == 4  # the partial block was copied
    run(engine, {})
    assert engine.pool.num_used == 0


def test_n_choices_are_seeded_and_distinct(tiny_models):
    path, _ = tiny_models["qwen2"]
    prompt = list(range(5, 19))
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    first = run(make_engine(path, block_size=4), {"n": (prompt, params)})["n"]
    again = run(make_engine(path, block_size=4), {"n": (prompt, params)})["n"]
    assert sorted(first) == [0, 1, 2, 3]
    assert len({tuple(t) for t in first.values()}) > 1
    assert again == first


def test_a_burst_from_one_session_does_not_starve_another(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, max_num_seqs=2)
    for i in range(4):
        engine.add_request(f"a{i}", [1 + i, 2, 3], greedy(6), session="agent-a")
    engine.add_request("b0", [7, 8, 9], greedy(6), session="agent-b")
    engine.add_request("none", [4, 5, 6], greedy(6))  # no session: a session of its own
    order = []
    while engine.has_work():
        for seq in engine.scheduler.running:
            if seq.request_id not in order:
                order.append(seq.request_id)
        engine.step()
    # First-come-first-served would run a0..a3 first; sessions take turns instead.
    assert order[:3] == ["a0", "b0", "none"]
    assert sorted(order) == ["a0", "a1", "a2", "a3", "b0", "none"]


def test_a_preempted_sequence_is_admitted_before_new_ones(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, max_num_seqs=1)
    engine.add_request("first", [1, 2, 3], greedy(8), session="x")
    engine.step()
    engine.add_request("second", [4, 5, 6], greedy(8), session="y")
    engine.scheduler.preempt(engine.scheduler.running[0])
    engine.step()
    assert [s.request_id for s in engine.scheduler.running] == ["first"]


def test_a_short_follow_up_turn_gets_the_looser_prefill_budget_beside_decodes():
    pacer = PrefillPacer(1.25, 4096, short_factor=2.0)
    pacer.observe(2, 0, 0.040)
    for tokens in (4, 8, 16, 32):  # 1 ms fixed, 0.25 ms a token: 64 tokens at 2.0x
        pacer.observe(2, tokens, 0.040 + 0.001 + 0.00025 * tokens)
    pool = BlockPool(4096)
    scheduler = Scheduler(pool, PrefixCache(pool, 16, enabled=False), 16, 8, 4096, pacer, 4)

    def running(name: str, prompt_len: int, computed: int, cached: int) -> Sequence:
        seq = Sequence(name, 0, list(range(prompt_len)), greedy(8), len(scheduler.running))
        seq.status, seq.num_computed, seq.num_cached_tokens = Status.RUNNING, computed, cached
        pool.grow(seq.block_table, computed, 16)
        scheduler.running.append(seq)
        return seq

    for i in range(2):
        running(f"decode{i}", 20, 19, 0)
    running("long", 3000, 0, 0)
    running("follow-up", 6000, 5900, 5900)  # 100 new tokens after a cached conversation
    chunks = {item.seq.request_id: item.num_new for item in scheduler.schedule()}
    assert chunks["follow-up"] == 64  # the short turn's bound
    assert "long" not in chunks  # its layers wait while a follow-up's chunk runs


def test_a_finished_sequence_releases_its_blocks_once_the_next_step_is_launched(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, speculation="off")
    engine.add_request("short", list(range(1, 40)), greedy(2))
    engine.add_request("long", list(range(50, 60)), greedy(12))
    while not any(d.request_id == "short" and d.finished for d in engine.step()):
        pass
    held = engine.pool.num_used  # the finished sequence's blocks are still held
    at_launch, at_collect = [], []
    launch, collect = engine.runner.launch, engine.runner.collect
    engine.runner.launch = lambda *a, **k: at_launch.append(engine.pool.num_used) or launch(*a, **k)
    engine.runner.collect = lambda *a: at_collect.append(engine.pool.num_used) or collect(*a)
    engine.step()
    # Launched first (on a GPU the host then releases while the device computes), and
    # released before the step's tokens are read.
    assert at_launch == [held] and at_collect[0] < held
    while engine.has_work():
        engine.step()
    assert engine.pool.num_used == 0


def test_a_sequence_short_of_blocks_takes_those_of_one_just_finished(tiny_models):
    path, _ = tiny_models["llama"]
    options = dict(speculation="off", block_size=4, max_num_batched_tokens=8)
    engine = make_engine(path, decode_stall_factor=float("inf"), **options)
    long_prompt = [(7 * i) % 512 for i in range(120)]
    engine.add_request("short", list(range(1, 11)), greedy(2))
    engine.add_request("long", long_prompt, greedy(4))
    out: dict[str, list[int]] = {"short": [], "long": []}

    def step() -> None:
        for d in engine.step():
            out[d.request_id].extend(d.new_token_ids)

    while len(out["short"]) < 2:
        step()
    # Every free block taken: the next chunk of "long" needs blocks that "short" holds.
    pool = engine.pool
    hogged = [pool.allocate() for _ in range(pool.num_free)]
    step()
    assert engine.stats.last_step_prefill_tokens == 8  # it did not wait a step for them
    for block in hogged:
        pool.release(block)
    while engine.has_work():
        step()
    assert engine.scheduler.num_preemptions == 0 and pool.num_used == 0
    alone = run(make_engine(path, **options), {"long": (long_prompt, greedy(4))})
    assert out["long"] == alone["long"][0]
