"""Prefix caching in the engine: hits across turns, sharing, and outputs equal to a cold run."""

import pytest

from kamado.engine.sampling_params import SamplingParams
from kamado.kv import block_hash
from tests.engine.conftest import greedy, hf_greedy, make_engine, run

BS = 4


def cached(engine, request_id, prompt, params, session=None) -> tuple[list[int], int]:
    """Run one request; returns its tokens and the cached prompt tokens it reported."""
    engine.add_request(request_id, prompt, params, session)
    tokens, hit = [], None
    while engine.has_work():
        for delta in engine.step():
            if delta.request_id == request_id and delta.index == 0:
                tokens += delta.new_token_ids
                hit = delta.num_cached_tokens
    return tokens, hit


def assert_no_leaks(engine):
    assert engine.pool.num_used == 0
    assert all(c == 0 for c in engine.pool.ref_counts)


def test_follow_up_turn_reuses_the_conversation_and_matches_transformers(tiny_models):
    path, reference = tiny_models["qwen2"]
    engine = make_engine(path, block_size=BS)
    turn1 = list(range(10, 47))  # 37 tokens: 9 full blocks
    out1, hit1 = cached(engine, "t1", turn1, greedy(8), "agent-a")
    assert hit1 == 0
    turn2 = turn1 + out1 + [300, 301, 302, 303, 304]
    out2, hit2 = cached(engine, "t2", turn2, greedy(10), "agent-a")
    # Every full block of turn 1's prompt and output, bar the one the sampled token opened.
    assert hit2 == (len(turn1) + len(out1) - 1) // BS * BS
    assert out2 == hf_greedy(reference, turn2, 10)
    assert engine.prefix.stats.device_hit_tokens == hit2
    assert engine.prefix.stats.queried_tokens == len(turn1) + len(turn2)
    assert_no_leaks(engine)


def test_a_follow_up_turn_takes_its_sessions_block_keys_instead_of_hashing_them(
    tiny_models, monkeypatch
):
    path, reference = tiny_models["qwen2"]
    engine = make_engine(path, block_size=BS)
    turn1 = list(range(10, 47))
    out1, _ = cached(engine, "t1", turn1, greedy(8), "agent")
    hashed: list[list[int]] = []
    real_key = block_hash.block_key
    monkeypatch.setattr(
        block_hash,
        "block_key",
        lambda parent, tokens: hashed.append(tokens) or real_key(parent, tokens),
    )

    def blocks(tokens: list[int], first: int, end: int) -> list[list[int]]:
        return [tokens[b * BS : (b + 1) * BS] for b in range(first, end)]

    # Repeating the reply: turn 1's whole chain (all but the block its last token opened).
    turn2 = turn1 + out1 + [300, 301, 302, 303, 304]
    out2, hit2 = cached(engine, "t2", turn2, greedy(10), "agent")
    chain1 = (len(turn1) + len(out1) - 1) // BS
    assert hit2 == chain1 * BS and out2 == hf_greedy(reference, turn2, 10)
    computed2 = (len(turn2) + len(out2) - 1) // BS  # full blocks keyed by turn 2's end
    assert hashed == blocks(turn2 + out2, chain1, computed2)
    # A reply rendered otherwise: only the previous prompt's blocks are taken.
    hashed.clear()
    turn3 = turn2 + [7, 7, 7] + out2[3:] + [400, 401]
    out3, hit3 = cached(engine, "t3", turn3, greedy(4), "agent")
    prompt2 = len(turn2) // BS
    assert hashed[: computed2 - prompt2] == blocks(turn3, prompt2, computed2)
    assert hit3 == len(turn2)  # up to the first changed token (a partial block copied)
    assert out3 == hf_greedy(reference, turn3, 4)
    assert_no_leaks(engine)


def test_a_different_prefix_misses_and_a_shared_system_prompt_hits(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, block_size=BS)
    system = list(range(100, 124))  # 6 full blocks
    cached(engine, "a", system + [1, 2, 3], greedy(4), "agent-a")
    assert cached(engine, "b", [7] + system, greedy(4), "agent-b")[1] == 0
    assert cached(engine, "c", system + [9, 9], greedy(4), "agent-c")[1] == len(system)


def test_a_retried_prompt_computes_only_its_last_token(tiny_models):
    path, reference = tiny_models["qwen3"]
    engine = make_engine(path, block_size=BS)
    prompt = list(range(20, 52))  # exactly 8 blocks
    first, _ = cached(engine, "a", prompt, greedy(6))
    again, hit = cached(engine, "b", prompt, greedy(6))
    # 7 shared blocks, and a copy of the 8th's first 3 tokens: the last one has the logits.
    assert hit == len(prompt) - 1
    assert engine.prefix.stats.partial_hit_tokens == BS - 1
    assert again == first == hf_greedy(reference, prompt, 6)
    assert_no_leaks(engine)


def test_concurrent_requests_read_the_same_blocks(tiny_models):
    path, _ = tiny_models["llama"]
    # Pacing off: the second request is admitted in the very next step.
    engine = make_engine(path, block_size=BS, decode_stall_factor=float("inf"))
    prompt = list(range(30, 70))
    engine.add_request("first", prompt, greedy(40))
    engine.step()  # the whole prompt is computed and its blocks cached
    engine.add_request("second", prompt + [5], greedy(40))
    engine.step()
    first, second = engine._requests["first"][0], engine._requests["second"][0]
    shared = len(prompt) // BS
    assert second.block_table[:shared] == first.block_table[:shared]
    assert all(engine.pool.ref_counts[b] == 2 for b in first.block_table[:shared])
    assert second.num_cached_tokens == shared * BS
    out = run(engine, {})
    cold = run(make_engine(path, block_size=BS), {"second": (prompt + [5], greedy(40))})
    # The steps already taken produced a token each; the rest must continue the cold run.
    assert cold["second"][0][-len(out["second"][0]) :] == out["second"][0]
    assert_no_leaks(engine)
    assert engine.pool.num_cached > 0


def test_agents_starting_together_compute_their_shared_prompt_once(tiny_models):
    path, reference = tiny_models["qwen2"]
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=8)  # chunked prefill
    system = list(range(40, 80))  # 10 blocks every agent's prompt starts with
    prompts = {f"agent{i}": system + [100 + i] * 6 for i in range(3)}
    out = run(engine, {rid: (prompt, greedy(5)) for rid, prompt in prompts.items()})
    for rid, prompt in prompts.items():
        assert out[rid][0] == hf_greedy(reference, prompt, 5)
    # One agent computed the system prompt; the others waited for its blocks.
    assert engine.stats.prompt_tokens_total < 2 * len(system)  # not 3x
    assert engine.prefix.stats.device_hit_tokens == 2 * len(system)
    assert_no_leaks(engine)


def test_a_short_prompt_computes_a_block_it_shares_with_a_long_one_rather_than_wait(
    tiny_models,
):
    path, reference = tiny_models["llama"]
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=64)
    long = [(7 * i) % 500 + 1 for i in range(216)]
    engine.add_request("long", long, greedy(2))
    engine.step()  # its first chunk, 64 tokens, is cached; the next block is computed next
    short = long[: 64 + BS] + [3, 4, 5]
    engine.add_request("short", short, greedy(2))
    # Its 7 tokens past the cached ones cost less than waiting for the long prompt's next
    # chunk of 64 to compute the block they start with: it computes them itself, at once.
    first = engine.step()
    assert [delta.request_id for delta in first] == ["short"]
    out = run(engine, {})
    assert first[0].new_token_ids + out["short"][0] == hf_greedy(reference, short, 2)
    assert out["long"][0] == hf_greedy(reference, long, 2)
    assert engine.prefix.stats.device_hit_tokens == 64
    assert_no_leaks(engine)


def test_a_request_waiting_on_an_aborted_prefill_computes_the_prompt_itself(tiny_models):
    path, reference = tiny_models["llama"]
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=8)
    prompt = list(range(30, 70))
    engine.add_request("first", prompt, greedy(3))
    engine.add_request("second", prompt + [7], greedy(3))
    engine.step()
    engine.step()
    assert engine.scheduler.waiting  # "second" waits for the blocks "first" is computing
    engine.abort("first")
    out = run(engine, {})
    assert out["second"][0] == hf_greedy(reference, prompt + [7], 3)
    assert_no_leaks(engine)


def test_n_choices_fork_from_a_cached_prefix(tiny_models):
    path, _ = tiny_models["qwen2"]
    prompt = list(range(5, 31))
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    cold = run(make_engine(path, block_size=BS), {"n": (prompt, params)})
    engine = make_engine(path, block_size=BS)
    cached(engine, "warm", prompt + [1], greedy(2))
    warm = run(engine, {"n": (prompt, params)})
    assert warm == cold
    assert engine.prefix.stats.device_hit_tokens > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("max_batched", [2048, 7], ids=["preempted", "chunked"])
def test_shared_prefixes_under_preemption_give_cold_outputs(tiny_models, max_batched):
    path, _ = tiny_models["qwen3"]
    system = list(range(200, 230))
    requests = {f"r{i}": (system + [i + 1] * (3 + 5 * i), greedy(12 + 3 * i)) for i in range(6)}
    alone = {}
    for request_id, request in requests.items():
        alone.update(run(make_engine(path, block_size=BS), {request_id: request}))
    engine = make_engine(
        path, block_size=BS, kv_cache_bytes=40 * 4096, max_num_batched_tokens=max_batched
    )
    first = run(engine, dict(list(requests.items())[:2]))
    rest = run(engine, dict(list(requests.items())[2:]))
    assert {**first, **rest} == alone
    if max_batched == 2048:  # everything admitted at once overflows the small pool
        assert engine.scheduler.num_preemptions > 0
    assert engine.prefix.stats.device_hit_tokens > 0
    assert_no_leaks(engine)


def test_aborted_requests_free_their_blocks(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, block_size=BS)
    prompt = list(range(40, 80))
    engine.add_request("a", prompt, greedy(50))
    engine.add_request("b", prompt + [3], SamplingParams(n=2, max_tokens=50, seed=1))
    for _ in range(3):
        engine.step()
    engine.abort("a")
    engine.abort("b", 1)
    engine.step()
    engine.abort("b")
    assert not engine.has_work()
    assert_no_leaks(engine)


def test_prefix_cache_off_computes_everything(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(40, 80))
    cached(engine, "a", prompt, greedy(3))
    assert cached(engine, "b", prompt, greedy(3))[1] == 0
    assert engine.pool.num_cached == 0
    assert_no_leaks(engine)


def test_a_turn_that_rewrites_the_sessions_history_is_counted(tiny_models):
    path, _ = tiny_models["llama"]
    engine = make_engine(path, block_size=BS)
    system, user = list(range(100, 116)), list(range(200, 220))  # 4 and 5 blocks
    first = system + user + [5, 6, 7]  # 39 tokens: 9 full prompt blocks
    out, _ = cached(engine, "t1", first, greedy(4), "agent")
    # Append-only: the next turn begins with the previous prompt (and its reply).
    cached(engine, "t2", first + out + [8, 9, 10, 11, 12], greedy(4), "agent")
    assert engine.prefix.stats.history_rewrites == 0
    second_prompt = first + out + [8, 9, 10, 11, 12]
    # Like a template dropping an old reasoning block: the user turn is rendered shorter.
    rewritten = system + user[:8] + user[12:] + second_prompt[len(system) + len(user) :]
    _, hit = cached(engine, "t3", rewritten, greedy(4), "agent")
    assert hit == len(system) + 8  # up to the first changed block
    stats = engine.prefix.stats
    assert stats.history_rewrites == 1
    # From the first changed block to where the previous prompt ended (or this one's last
    # full block, if it is shorter): the recomputed part of what was history.
    comparable = min(len(second_prompt) // BS, (len(rewritten) - 1) // BS)
    assert stats.history_rewritten_tokens == (comparable - 6) * BS
    # Another conversation under the same key (nothing shared) is not a rewrite.
    cached(engine, "t4", list(range(300, 340)), greedy(4), "agent")
    assert engine.prefix.stats.history_rewrites == 1


def test_a_turn_aborted_inside_its_prefill_leaves_a_usable_session(tiny_models):
    path, reference = tiny_models["llama"]
    engine = make_engine(path, block_size=BS, max_num_batched_tokens=8)
    prompt = list(range(10, 60))
    engine.add_request("a", prompt, greedy(3), "agent")
    engine.step()
    engine.step()  # 16 of its 50 prompt tokens computed
    engine.abort("a")
    out, hit = cached(engine, "b", prompt + [1, 2, 3], greedy(3), "agent")
    assert hit == 16 and out == hf_greedy(reference, prompt + [1, 2, 3], 3)
    assert engine.prefix.stats.history_rewrites == 0
    assert_no_leaks(engine)
