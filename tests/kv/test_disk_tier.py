"""The disk tier: evicted blocks restored with cold-run outputs, across restarts; bad,
foreign and mismatched files never loaded."""

from pathlib import Path

import pytest
import torch

from kamado.engine import scheduler
from kamado.kv.block_hash import extend_keys
from kamado.kv.cache import bytes_per_block
from kamado.kv.disk_tier import HEADER, DiskTier
from kamado.kv.quant import kv_format
from kamado.models import load_model_config, resolve_model
from tests.engine.conftest import FixedPacer, greedy, hf_greedy, make_engine, run

BS = 4
PROMPT = list(range(50, 90))  # 10 full blocks
FILLER = [7 + i % 40 for i in range(88)]  # pushes most of PROMPT's blocks out of the pool
NUM_BLOCKS = 24


def block_bytes(path: Path, kv_cache_dtype: str = "auto") -> int:
    config = load_model_config(resolve_model(str(path)))
    kv = kv_format(kv_cache_dtype, torch.float32, "cpu")
    return bytes_per_block(config, BS, torch.float32, kv)


def small_engine(path: Path, disk: Path | None, num_blocks: int = NUM_BLOCKS, **options):
    """An engine with room for `num_blocks` blocks and its disk tier in `disk` (None: off)."""
    per_block = block_bytes(path, options.get("kv_cache_dtype", "auto"))
    return make_engine(
        path,
        block_size=BS,
        kv_cache_bytes=num_blocks * per_block,
        kv_disk_dir=None if disk is None else str(disk),
        **options,
    )


def evict_prompt(engine) -> None:
    run(engine, {"p": (PROMPT, greedy(4))})
    run(engine, {"filler": (FILLER, greedy(2))})
    assert engine.pool.num_evictions > 0
    engine.close()  # its files are written, as at a clean shutdown


def test_evicted_blocks_come_back_from_disk_with_cold_outputs(tiny_models, tmp_path):
    path, reference = tiny_models["qwen2"]
    engine = small_engine(path, tmp_path)
    evict_prompt(engine)
    engine.disk.flush()
    assert engine.disk.bytes_written > 0
    out = run(engine, {"again": (PROMPT, greedy(12))})["again"][0]
    stats = engine.prefix.stats
    assert stats.disk_hit_tokens > 0
    assert stats.device_hit_tokens + stats.disk_hit_tokens == len(PROMPT) - BS
    assert engine.transfers.stats.disk_to_device > 0
    assert out == hf_greedy(reference, PROMPT, 12)
    assert engine.pool.num_used == 0


def test_a_restarted_engine_starts_with_the_disk_tier_warm(tiny_models, tmp_path):
    path, reference = tiny_models["llama"]
    evict_prompt(small_engine(path, tmp_path))
    restarted = small_engine(path, tmp_path)
    out = run(restarted, {"again": (PROMPT, greedy(10))})["again"][0]
    assert restarted.prefix.stats.disk_hit_tokens == len(PROMPT) - BS
    assert out == hf_greedy(reference, PROMPT, 10)


def test_a_short_turn_from_disk_goes_ahead_of_a_long_prompt(tiny_models, tmp_path, monkeypatch):
    path, reference = tiny_models["llama"]
    evict_prompt(small_engine(path, tmp_path))
    engine = small_engine(path, tmp_path, 2 * NUM_BLOCKS, max_num_batched_tokens=8)
    # Prompts of more than 32 new tokens are long; nothing decodes, so they run whole.
    engine.pacer = engine.scheduler.pacer = FixedPacer(8, 1, short=8, long=32)
    # The turn's ten blocks come back in well under the default wait; a loaded machine
    # must not make the test depend on it.
    monkeypatch.setattr(scheduler, "SHORT_TURN_RESTORE_WAIT_S", 30.0)
    long_prompt, turn = [300 + i for i in range(64)], PROMPT + [5, 6, 7]
    engine.add_request("long", long_prompt, greedy(2))
    engine.step()
    engine.add_request("turn", turn, greedy(3))  # PROMPT's blocks are on disk only
    first: dict[str, int] = {}
    out: dict[str, list[int]] = {"long": [], "turn": []}
    step = 0
    while engine.has_work():
        step += 1
        for delta in engine.step():
            first.setdefault(delta.request_id, step)
            out[delta.request_id] += delta.new_token_ids
    # Restored while the step waited, the turn ran in the step after it came. Before, it
    # gave way to each chunk of the long prompt till its last (first token at step 9), and
    # without the wait it would run a step later (the long prompt's chunk meanwhile).
    assert first["turn"] == 1 < first["long"]
    assert engine.prefix.stats.disk_hit_tokens == len(PROMPT)
    assert out["turn"] == hf_greedy(reference, turn, 3)
    assert out["long"] == hf_greedy(reference, long_prompt, 2)
    assert engine.pool.num_used == 0


def test_corrupted_files_are_ignored_and_removed(tiny_models, tmp_path):
    path, reference = tiny_models["llama"]
    first = small_engine(path, tmp_path)
    evict_prompt(first)
    keys: list[bytes] = []
    extend_keys(keys, PROMPT, len(PROMPT) // BS, BS)
    damaged = tmp_path / first.disk._name(keys[4])
    raw = bytearray(damaged.read_bytes())
    raw[HEADER.size + 10] ^= 0xFF  # one flipped payload byte: the checksum catches it
    damaged.write_bytes(bytes(raw))
    (tmp_path / "truncated.kvb").write_bytes(b"KAMADOKV\x01")
    restarted = small_engine(path, tmp_path)
    assert not (tmp_path / "truncated.kvb").exists()
    out = run(restarted, {"again": (PROMPT, greedy(10))})["again"][0]
    assert out == hf_greedy(reference, PROMPT, 10)
    assert restarted.disk.num_corrupt == 2
    assert restarted.disk.load(keys[4]) is not None  # rewritten from the recomputed block
    assert restarted.prefix.stats.disk_hit_tokens == 4 * BS  # the blocks before the bad one


@pytest.mark.parametrize(
    ("ours", "other"),
    [
        ({}, {"dtype": "bfloat16"}),
        ({}, {"model": "qwen3"}),
        ({}, {"kv_cache_dtype": "int8"}),
        # Same bytes per block, other codes: only the fingerprint tells them apart.
        ({"kv_cache_dtype": "int8"}, {"kv_cache_dtype": "fp8"}),
        ({"kv_cache_dtype": "fp8"}, {"kv_cache_dtype": "fp8-static"}),
    ],
    ids=["other-dtype", "other-model", "auto-then-int8", "int8-then-fp8", "fp8-then-static"],
)
def test_files_of_another_model_or_dtype_are_never_loaded(tiny_models, tmp_path, ours, other):
    path, _ = tiny_models["llama"]
    evict_prompt(small_engine(path, tmp_path, **ours))
    written = {p.name for p in tmp_path.glob("*.kvb")}
    other_path = tiny_models[other.pop("model")][0] if "model" in other else path
    engine = small_engine(other_path, tmp_path, **other)
    assert len(engine.disk) == 0
    run(engine, {"again": (PROMPT, greedy(4))})
    assert engine.prefix.stats.disk_hit_tokens == 0
    assert written <= {p.name for p in tmp_path.glob("*.kvb")}  # left alone


def test_a_file_renamed_to_our_key_is_refused_by_its_header(tmp_path):
    ours = DiskTier(tmp_path, 1 << 20, b"A" * 16, 64)
    theirs = DiskTier(tmp_path / "x", 1 << 20, b"B" * 16, 64)
    theirs.store(b"k" * 16, torch.ones(16))
    theirs.flush()
    forged = tmp_path / ours._name(b"k" * 16)
    (tmp_path / "x" / theirs._name(b"k" * 16)).rename(forged)
    reopened = DiskTier(tmp_path, 1 << 20, b"A" * 16, 64)
    assert b"k" * 16 not in reopened and reopened.load(b"k" * 16) is None


def test_the_directory_stays_under_its_cap_dropping_the_least_recent(tmp_path):
    shape = (2, 2, 4, 2, 8)
    block_bytes = torch.zeros(shape).numel() * 4
    one = block_bytes + HEADER.size
    tier = DiskTier(tmp_path, 3 * one, b"F" * 16, block_bytes)
    keys = [bytes([i]) * 16 for i in range(5)]
    for i, key in enumerate(keys[:3]):
        tier.store(key, torch.full(shape, float(i)))
    tier.flush()
    assert tier.load(keys[0]) is not None  # used: now the most recent
    tier.store(keys[3], torch.zeros(shape))
    tier.flush()
    assert keys[1] not in tier and keys[0] in tier
    assert tier.num_bytes <= 3 * one and tier.num_removed == 1
    assert torch.equal(tier.load(keys[2]).view(torch.float32).view(shape), torch.full(shape, 2.0))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "fp8-static"])
def test_quantized_blocks_come_back_from_disk_after_a_restart(
    tiny_models, tmp_path, kv_cache_dtype
):
    path, _ = tiny_models["qwen2"]
    cold = run(
        small_engine(path, tmp_path / "cold", kv_cache_dtype=kv_cache_dtype),
        {"p": (PROMPT, greedy(10))},
    )
    evict_prompt(small_engine(path, tmp_path, kv_cache_dtype=kv_cache_dtype))
    restarted = small_engine(path, tmp_path, kv_cache_dtype=kv_cache_dtype)
    out = run(restarted, {"again": (PROMPT, greedy(10))})["again"][0]
    assert restarted.prefix.stats.disk_hit_tokens == len(PROMPT) - BS
    assert out == cold["p"][0]  # codes and scales restored byte for byte


def test_a_block_that_fails_to_write_does_not_stop_the_writer(tmp_path, monkeypatch):
    from kamado.kv import disk_tier

    tier = DiskTier(tmp_path, 1 << 20, b"F" * 16, 64)
    checksum = disk_tier._checksum
    monkeypatch.setattr(disk_tier, "_checksum", lambda payload: 1 / 0)
    tier.store(b"a" * 16, torch.ones(16))
    tier.flush()  # returns: the failure was logged, not raised in the thread
    assert b"a" * 16 not in tier
    monkeypatch.setattr(disk_tier, "_checksum", checksum)
    tier.store(b"b" * 16, torch.ones(16))
    tier.flush()
    assert torch.equal(tier.load(b"b" * 16).view(torch.float32), torch.ones(16))
