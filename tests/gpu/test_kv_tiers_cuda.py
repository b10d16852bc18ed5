"""The host-RAM tier on CUDA: blocks the GPU evicts go to pinned memory (and on to disk)
and come back byte for byte, so a turn restored from below decodes exactly as one whose
prefix stayed on the GPU (synthetic qwen3-0.6b shapes, bf16)."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from kamado.config import EngineConfig  # noqa: E402
from kamado.engine.core import EngineCore  # noqa: E402
from kamado.engine.sampling_params import SamplingParams  # noqa: E402
from kamado.kv.block_hash import extend_keys  # noqa: E402
from kamado.kv.tier_transfers import RESTORE_CHUNK  # noqa: E402

pytestmark = pytest.mark.gpu
BS = 16
PROMPT = [(j * 7919) % 30000 + 100 for j in range(1100)]  # 68 full blocks: > one chunk
FILLER = [(j * 104729) % 30000 + 100 for j in range(1250)]
NUM_BLOCKS = 80  # FILLER evicts all of PROMPT's blocks but about one
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


BLOCK_BYTES = 28 * BS * 2 * 8 * 128 * 2  # layers x tokens x (K, V) x heads x dim x bf16


def engine(num_blocks: int, **options) -> EngineCore:
    core = EngineCore(
        EngineConfig(
            model="synthetic:qwen3-0.6b", device="cuda", dtype="bfloat16",
            kv_cache_bytes=num_blocks * BLOCK_BYTES, block_size=BS, speculation="off",
            **options,
        )
    )  # fmt: skip
    assert core.runner.cache.block_bytes == BLOCK_BYTES
    return core


def run(core: EngineCore, request_id: str, prompt: list[int]) -> list[int]:
    core.add_request(request_id, prompt, PARAMS)
    out: list[int] = []
    while core.has_work():
        for delta in core.step():
            out += delta.new_token_ids
    return out


def prompt_blocks(core: EngineCore) -> dict[bytes, torch.Tensor]:
    keys: list[bytes] = []
    extend_keys(keys, PROMPT, len(PROMPT) // BS, BS)
    return {key: core.runner.cache.read_block(core.pool.lookup(key)).cpu() for key in keys}


def test_a_prefix_back_from_host_ram_decodes_as_one_that_stayed(tmp_path):
    assert len(PROMPT) // BS > RESTORE_CHUNK
    stayed = engine(4 * NUM_BLOCKS, kv_host_bytes=0, kv_disk_dir=None)
    run(stayed, "first", PROMPT)
    expected = run(stayed, "again", PROMPT)
    # 68 full blocks, and 11 tokens copied from the block the first run filled on.
    assert stayed.prefix.stats.device_hit_tokens == len(PROMPT) - 1

    tiered = engine(NUM_BLOCKS, kv_host_bytes=200 * BLOCK_BYTES, kv_disk_dir=None)
    assert tiered.host is not None and tiered.host.slots.is_pinned()
    run(tiered, "first", PROMPT)
    before = prompt_blocks(tiered)
    run(tiered, "filler", FILLER)
    assert sum(key in tiered.host for key in before) > RESTORE_CHUNK
    assert run(tiered, "again", PROMPT) == expected
    stats = tiered.prefix.stats
    assert stats.host_hit_tokens > RESTORE_CHUNK * BS
    full_blocks = stats.host_hit_tokens + stats.device_hit_tokens - stats.partial_hit_tokens
    assert full_blocks == len(PROMPT) // BS * BS
    after = prompt_blocks(tiered)
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert tiered.pool.num_used == 0


def test_a_prefix_back_from_disk_behind_a_small_host_tier(tmp_path):
    stayed = engine(4 * NUM_BLOCKS, kv_host_bytes=0, kv_disk_dir=None)
    run(stayed, "first", PROMPT)
    expected = run(stayed, "again", PROMPT)
    tiered = engine(NUM_BLOCKS, kv_host_bytes=8 * BLOCK_BYTES, kv_disk_dir=str(tmp_path))
    run(tiered, "first", PROMPT)
    before = prompt_blocks(tiered)
    run(tiered, "filler", FILLER)
    tiered.disk.flush()
    assert run(tiered, "again", PROMPT) == expected
    stats = tiered.prefix.stats
    assert stats.disk_hit_tokens > 0
    hits = stats.host_hit_tokens + stats.disk_hit_tokens + stats.device_hit_tokens
    assert hits - stats.partial_hit_tokens == len(PROMPT) // BS * BS
    after = prompt_blocks(tiered)
    assert all(torch.equal(before[key], after[key]) for key in before)
    assert tiered.pool.num_used == 0
