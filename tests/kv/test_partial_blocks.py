"""Reuse inside a block: the computed tokens of a partly filled block (or the first tokens
of a full one) are copied into the next sequence that starts with them."""

import pytest
import torch

from kamado.kv.block_hash import extend_keys
from kamado.kv.block_tokens import BlockTokens, partial_block_key
from kamado.kv.cache import bytes_per_block
from kamado.kv.quant import kv_format
from kamado.models import load_model_config, resolve_model
from tests.engine.conftest import greedy, hf_greedy, make_engine, run
from tests.kv.test_prefix_cache import assert_no_leaks, cached

BS = 4
TURN1 = list(range(10, 47))  # 37 tokens


def follow_up(turn: list[int], reply: list[int], new: int) -> list[int]:
    return turn + reply + [300 + new + i for i in range(5)]


def filed_blocks_are_cached(engine) -> bool:
    """Every block found by its tokens still holds them: its slot was not reused."""
    return all(b in engine.pool.key_of for b in engine.prefix.block_tokens._parent_of)


def tail_key(tokens: list[int], num_computed: int) -> bytes:
    """The pool key of the partly filled block a sequence of `tokens` leaves behind."""
    keys: list[bytes] = []
    extend_keys(keys, tokens, num_computed // BS, BS)
    return partial_block_key(keys[-1], tokens[num_computed // BS * BS : num_computed])


def small_engine_with_disk(path, disk):
    """24 blocks, and a disk tier to evict to."""
    config = load_model_config(resolve_model(str(path)))
    per_block = bytes_per_block(config, BS, torch.float32, kv_format("auto", torch.float32, "cpu"))
    return make_engine(path, block_size=BS, kv_cache_bytes=24 * per_block, kv_disk_dir=str(disk))


def kv_at(engine, table: list[int], positions: range) -> list[torch.Tensor]:
    """Per layer, the K and V the cache holds for `positions` of a sequence with `table`."""
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in positions])
    cache = engine.runner.cache
    return [torch.stack(cache.read(layer, slots)) for layer in range(len(cache.k))]


def start(engine, prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    """Add requests and step until each has its first token (after any blocks it waits
    for came back from disk); the tokens so far."""
    for name, prompt in prompts.items():
        engine.add_request(name, prompt, greedy(n))
    out = {name: [] for name in prompts}
    while not all(out.values()):
        for delta in engine.step():
            out[delta.request_id] += delta.new_token_ids
    return out


def test_the_longest_shared_start_wins_under_the_same_parent_only():
    index = BlockTokens(BS)
    index.add(5, b"p", [1, 2])
    index.add(6, b"p", [1, 2, 3, 9])
    index.add(7, b"q", [1, 2, 3, 4])
    found = index.longest(b"p", [1, 2, 3])
    assert (found.block, found.num_tokens) == (6, 3)
    assert index.longest(b"p", [2]) is None
    assert index.forget(5) and not index.forget(6)  # partly filled, full
    assert not index.forget(6)  # forgotten already
    assert index.longest(b"p", [1, 2, 3]) is None and len(index) == 1


def test_a_follow_up_turn_continues_the_partly_filled_block(tiny_models):
    path, reference = tiny_models["qwen2"]
    engine = make_engine(path, block_size=BS)
    reply, _ = cached(engine, "t1", TURN1, greedy(6), "agent")
    computed = len(TURN1) + len(reply) - 1  # 42: 10 full blocks and 2 tokens
    turn2 = follow_up(TURN1, reply, 0)
    out, hit = cached(engine, "t2", turn2, greedy(10), "agent")
    assert hit == computed
    assert engine.prefix.stats.partial_hit_tokens == computed % BS
    assert engine.prefix.stats.device_hit_tokens == hit
    assert out == hf_greedy(reference, turn2, 10)
    # The newer turn filled that block itself: the older tail is evicted first.
    older = engine.pool.lookup(tail_key(TURN1 + reply, computed))
    assert older in engine.pool.evictable._superseded
    assert filed_blocks_are_cached(engine)
    assert_no_leaks(engine)


def test_a_retry_copies_the_prompt_tail_from_a_block_that_went_on_with_the_reply(tiny_models):
    path, reference = tiny_models["llama"]
    engine = make_engine(path, block_size=BS)
    prompt = list(range(60, 90))  # 7 full blocks and 2 tokens
    first, _ = cached(engine, "a", prompt, greedy(2))  # that block holds 2 prompt tokens + 1
    again, hit = cached(engine, "b", prompt, greedy(5))
    assert hit == len(prompt) - 1
    assert engine.prefix.stats.partial_hit_tokens == 1
    assert again[:2] == first and again == hf_greedy(reference, prompt, 5)
    assert_no_leaks(engine)


def test_concurrent_followers_each_write_into_their_own_copy(tiny_models):
    path, reference = tiny_models["qwen3"]
    engine = make_engine(path, block_size=BS, decode_stall_factor=float("inf"))
    reply, _ = cached(engine, "t1", TURN1, greedy(6))
    computed = len(TURN1) + len(reply) - 1
    source = engine.pool.lookup(tail_key(TURN1 + reply, computed))
    prompts = {name: follow_up(TURN1, reply, 10 * i) for i, name in enumerate(["x", "y"])}
    out = start(engine, prompts, 8)
    x, y = (engine._requests[name][0] for name in prompts)
    assert x.num_cached_tokens == y.num_cached_tokens == computed
    copies = {x.block_table[computed // BS], y.block_table[computed // BS]}
    assert len(copies) == 2 and source not in copies
    # The copied tokens hold the K/V a cold run computes for them.
    cold = make_engine(path, block_size=BS, enable_prefix_caching=False)
    start(cold, {"x": prompts["x"]}, 8)
    tail = range(computed // BS * BS, computed)
    expected = kv_at(cold, cold._requests["x"][0].block_table, tail)
    for seq in (x, y):
        for got, want in zip(kv_at(engine, seq.block_table, tail), expected, strict=True):
            torch.testing.assert_close(got, want)
    assert engine.pool.ref_counts[source] == 0  # cached, read by no one, still findable
    assert engine.pool.lookup(tail_key(TURN1 + reply, computed)) == source
    for name, tokens in run(engine, {}).items():
        out[name] += tokens[0]
    assert all(out[name] == hf_greedy(reference, p, 8) for name, p in prompts.items())
    assert filed_blocks_are_cached(engine)
    assert_no_leaks(engine)


def test_partial_blocks_are_evicted_first_and_never_written_to_disk(tiny_models, tmp_path):
    path, reference = tiny_models["llama"]
    engine = small_engine_with_disk(path, tmp_path)
    prompt = list(range(100, 130))
    reply, _ = cached(engine, "a", prompt, greedy(4), "agent-a")  # 8 full blocks and 1 token
    tail = tail_key(prompt + reply, len(prompt) + 3)
    assert engine.pool.lookup(tail) is not None
    # Another agent's turn takes 17 blocks: the idle agent's deepest block goes first.
    cached(engine, "b", [7 + i % 40 for i in range(66)], greedy(2), "agent-b")
    assert engine.pool.num_evictions == 2
    assert engine.pool.lookup(tail) is None and tail not in engine.disk
    assert filed_blocks_are_cached(engine)
    turn2 = prompt + reply + [5, 6, 7]
    out, hit = cached(engine, "a2", turn2, greedy(6), "agent-a")
    assert hit == 8 * BS and engine.prefix.stats.disk_hit_tokens == BS  # the 8th came back
    assert engine.prefix.stats.partial_hit_tokens == 0
    assert out == hf_greedy(reference, turn2, 6)
    assert_no_leaks(engine)


def test_the_copied_block_outlives_the_evictions_that_bring_blocks_back_from_disk(
    tiny_models, tmp_path
):
    path, _ = tiny_models["qwen2"]
    engine = small_engine_with_disk(path, tmp_path)
    prompt = list(range(100, 130))
    reply, _ = cached(engine, "p", prompt, greedy(4))  # 8 full blocks and 1 token
    # Without a session, blocks go in release order: this evicts the first 3, and fills
    # every other block, so each block that comes back from disk evicts one more.
    cached(engine, "filler", [7 + i % 40 for i in range(69)], greedy(2))
    assert engine.pool.num_evictions == 3 and engine.pool.num_free == engine.pool.num_cached
    turn2 = prompt + reply + [5, 6, 7]
    # 3 blocks from disk, then 3 tokens copied from the 4th, the next block to be evicted.
    start(engine, {"t2": turn2}, 4)
    seq = engine._requests["t2"][0]
    assert seq.num_cached_tokens == 3 * BS + 3 and engine.prefix.stats.disk_hit_tokens == 3 * BS
    cold = make_engine(path, block_size=BS, enable_prefix_caching=False)
    start(cold, {"t2": turn2}, 4)
    copied = range(3 * BS, 3 * BS + 3)
    expected = kv_at(cold, cold._requests["t2"][0].block_table, copied)
    for got, want in zip(kv_at(engine, seq.block_table, copied), expected, strict=True):
        torch.testing.assert_close(got, want)
    run(engine, {})
    assert_no_leaks(engine)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_blocks_copy_codes_and_scales(tiny_models, name):
    path, _ = tiny_models["qwen2"]
    engine = make_engine(path, block_size=BS, kv_cache_dtype=name)
    reply, _ = cached(engine, "t1", TURN1, greedy(6), "agent")
    computed = len(TURN1) + len(reply) - 1
    source = engine.pool.lookup(tail_key(TURN1 + reply, computed))
    turn2 = follow_up(TURN1, reply, 0)
    out = start(engine, {"t2": turn2}, 10)["t2"]
    seq = engine._requests["t2"][0]
    assert seq.num_cached_tokens == computed and engine.prefix.stats.partial_hit_tokens > 0
    tail = range(computed // BS * BS, computed)
    codes = kv_at(engine, seq.block_table, tail)
    at_source = kv_at(engine, [source] * len(seq.block_table), tail)
    assert all(torch.equal(a, b) for a, b in zip(codes, at_source, strict=True))
    out += run(engine, {})["t2"][0]
    cold = make_engine(path, block_size=BS, kv_cache_dtype=name, enable_prefix_caching=False)
    assert out == run(cold, {"t2": (turn2, greedy(10))})["t2"][0]
    assert_no_leaks(engine)
