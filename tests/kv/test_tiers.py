"""Host-RAM and disk tiers: blocks the device evicts move down, come back while the other
sequences keep stepping, and give cold-run outputs; nothing leaks."""

import threading
import time

import torch

from kamado.kv import tier_transfers
from kamado.kv.disk_tier import DiskTier
from kamado.kv.host_tier import HostTier
from tests.engine.conftest import greedy, hf_greedy, run
from tests.kv.test_disk_tier import BS, PROMPT, block_bytes, evict_prompt, small_engine

RESTORABLE = len(PROMPT) - BS  # the block holding the last prompt token is computed


def test_evicted_blocks_wait_in_host_ram_and_come_back_with_cold_outputs(tiny_models, monkeypatch):
    path, reference = tiny_models["qwen2"]
    monkeypatch.setattr(tier_transfers, "RESTORE_CHUNK", 4)  # several chunks
    engine = small_engine(path, None, kv_host_bytes=64 * block_bytes(path))
    assert engine.disk is None and engine.host is not None
    evict_prompt(engine)
    assert len(engine.host) == engine.pool.num_evictions
    assert engine.snapshot().tier_bytes[("device", "host")] > 0
    out = run(engine, {"again": (PROMPT, greedy(12))})["again"][0]
    stats = engine.prefix.stats
    assert stats.host_hit_tokens > 0 and stats.disk_hit_tokens == 0
    assert stats.device_hit_tokens + stats.host_hit_tokens == RESTORABLE
    assert out == hf_greedy(reference, PROMPT, 12)
    assert engine.pool.num_used == 0


def test_a_full_host_tier_leaves_its_oldest_blocks_on_disk(tiny_models, tmp_path):
    path, reference = tiny_models["llama"]
    engine = small_engine(path, tmp_path, kv_host_bytes=3 * block_bytes(path))
    evict_prompt(engine)
    # The rest were pushed out of host RAM, or (slots still being written) went straight
    # to disk: which, depends on the disk writer's pace.
    assert len(engine.host) == 3
    assert engine.host.num_evictions + engine.host.num_bypassed > 0
    assert len(engine.disk) >= engine.pool.num_evictions  # every evicted block, written
    out = run(engine, {"again": (PROMPT, greedy(10))})["again"][0]
    stats = engine.prefix.stats
    assert stats.disk_hit_tokens > 0
    assert stats.device_hit_tokens + stats.host_hit_tokens + stats.disk_hit_tokens == RESTORABLE
    assert out == hf_greedy(reference, PROMPT, 10)
    assert engine.pool.num_used == 0


def slow_disk(monkeypatch, seconds: float) -> threading.Event:
    """Every disk read takes `seconds`; the event is set when the first read starts."""
    started = threading.Event()
    load = DiskTier.load

    def slow_load(self, key):
        started.set()
        time.sleep(seconds)
        return load(self, key)

    monkeypatch.setattr(DiskTier, "load", slow_load)
    return started


def test_other_sequences_keep_decoding_while_a_prefix_comes_back(
    tiny_models, tmp_path, monkeypatch
):
    path, reference = tiny_models["qwen2"]
    evict_prompt(small_engine(path, tmp_path))
    engine = small_engine(path, tmp_path)  # restarted: the prompt's blocks are on disk only
    decoding = [3 + i % 20 for i in range(9)]
    engine.add_request("decoding", decoding, greedy(40))
    for _ in range(3):
        engine.step()
    slow_disk(monkeypatch, 0.1)  # ~0.9 s for the prompt's 9 blocks
    engine.add_request("again", PROMPT, greedy(6))
    tokens_while_restoring = 0
    outputs: dict[str, list[int]] = {}
    while engine.has_work():
        restoring = any(s.restore is not None for s in engine.scheduler.waiting)
        for delta in engine.step():
            outputs.setdefault(delta.request_id, []).extend(delta.new_token_ids)
            if restoring and delta.request_id == "decoding":
                tokens_while_restoring += len(delta.new_token_ids)
    assert tokens_while_restoring >= 3
    assert engine.prefix.stats.disk_hit_tokens == RESTORABLE
    assert outputs["again"] == hf_greedy(reference, PROMPT, 6)
    assert engine.pool.num_used == 0


def test_aborting_a_request_while_its_prefix_comes_back_frees_everything(
    tiny_models, tmp_path, monkeypatch
):
    path, _ = tiny_models["llama"]
    evict_prompt(small_engine(path, tmp_path))
    engine = small_engine(path, tmp_path)
    started = slow_disk(monkeypatch, 0.05)
    engine.add_request("again", PROMPT, greedy(4))
    engine.step()
    assert started.wait(5) and engine.scheduler.waiting[0].restore is not None
    engine.abort("again")
    assert not engine.has_work()
    assert engine.pool.num_used == 0


def test_host_slots_in_use_are_never_reused_and_the_oldest_free_one_goes_first(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20, b"F" * 16, 8)
    host = HostTier(3 * 8, 8, pin=False, disk=disk)
    keys = [bytes([i]) * 16 for i in range(5)]
    slots = host.claim(keys[:3])
    for slot, value in zip(slots, (1, 2, 3), strict=True):
        host.slots[slot].fill_(value)
    host.filled(keys[:3], slots, None)
    disk.flush()  # the disk writer let go of the slots
    taken, _ = host.take(keys[1])  # a restore reads this slot: not reusable until released
    assert keys[1] not in host
    (fresh,) = host.claim([keys[3]])
    assert fresh == slots[0] and keys[0] not in host  # the oldest, written to disk already
    assert torch.equal(disk.load(keys[0]), torch.full((8,), 1, dtype=torch.uint8))
    host.filled([keys[3]], [fresh], None)
    disk.flush()
    (other,) = host.claim([keys[4]])
    assert other == slots[2]  # keys[1]'s slot is still being read
    host.release(taken)
    assert host.num_bypassed == 0 and host.num_evictions == 2
