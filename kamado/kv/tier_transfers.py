"""Moving KV blocks between the device cache and the lower tiers (host RAM, disk).

Down: on CPU (no host tier) a block goes to disk as soon as it fills, so the tier also
survives a crash; with a host tier, blocks the device evicts are copied there, in one
batch per step, queued on the device's stream ahead of whatever overwrites them.

Up: a sequence whose cached prefix continues in host RAM or on disk gets device blocks for
it, and a worker thread fills them (disk reads, host-to-device copies on a stream of its
own) while the engine keeps stepping the other sequences. The sequence runs once its
blocks are back.
"""

from __future__ import annotations

import concurrent.futures
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from kamado.device_copy import to_device
from kamado.kv.cache import KVCache
from kamado.kv.disk_tier import DiskTier
from kamado.kv.host_tier import HostTier

log = logging.getLogger(__name__)

RESTORE_CHUNK = 64  # blocks staged on the device per scatter into the cache


@dataclass
class TierStats:
    """Bytes moved between tiers, by direction (the disk tier counts what it writes)."""

    device_to_host: int = 0
    host_to_device: int = 0
    disk_to_device: int = 0


@dataclass
class Restore:
    """Blocks of one sequence coming back from host RAM or disk."""

    blocks: list[int]  # device blocks being filled, in order
    keys: list[bytes]
    host_slots: list[tuple[int, Any] | None]  # (slot, its fill event) for blocks in host RAM
    future: concurrent.futures.Future[None] | None = None
    num_loaded: int = 0  # blocks filled, from the first: a failed disk read ends the run
    cancelled: bool = False
    sources: list[str] = field(default_factory=list)  # "host" or "disk", per loaded block

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self, seconds: float) -> bool:
        """Wait at most `seconds` for the blocks; whether they are all back."""
        if self.future is not None:
            concurrent.futures.wait([self.future], timeout=seconds)
        return self.done()


class TierTransfers:
    def __init__(self, cache: KVCache, host: HostTier | None, disk: DiskTier | None) -> None:
        self.cache = cache
        self.host = host
        self.disk = disk
        self.device = cache.k[0].device
        self.stats = TierStats()
        self._evicted: list[tuple[int, bytes]] = []  # device blocks to copy to host RAM
        self._restores: list[Restore] = []
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kv-restore")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def __contains__(self, key: bytes) -> bool:
        return (self.host is not None and key in self.host) or (
            self.disk is not None and key in self.disk
        )

    # ---- down -------------------------------------------------------------------------

    def filled(self, block: int, key: bytes) -> None:
        """A device block now holds the full K/V of `key`."""
        if self.host is None:
            self._to_disk(block, key)

    def evicting(self, block: int, key: bytes) -> None:
        """The device is about to reuse a cached block: keep its K/V below."""
        if self.host is not None:
            self._evicted.append((block, key))  # copied in save_evicted, batched
        else:
            self._to_disk(block, key)  # the disk tier dropped it since it filled

    def _to_disk(self, block: int, key: bytes) -> None:
        if self.disk is not None and key not in self.disk:
            self.disk.store(key, self.cache.read_block(block))

    def save_evicted(self) -> None:
        """Copy the blocks evicted since the last call to host RAM. Call it before anything
        writes into newly allocated blocks (the forward pass, a fork's copy, a restore)."""
        if not self._evicted:
            return
        assert self.host is not None
        evicted, self._evicted = self._evicted, []
        slots = self.host.claim([key for _, key in evicted])
        moving = [(b, k, s) for (b, k), s in zip(evicted, slots, strict=True) if s is not None]
        for (block, key), slot in zip(evicted, slots, strict=True):
            if slot is None and key not in self.host:
                self._to_disk(block, key)  # every slot is still being copied out: bypass
        if not moving:
            return
        blocks = to_device([b for b, _, _ in moving], self.device)
        rows = self.cache.gather_blocks(blocks)
        for row, (_, _, slot) in zip(rows, moving, strict=True):
            self.host.slots[slot].copy_(row, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.host.filled([k for _, k, _ in moving], [s for _, _, s in moving], event)
        self.stats.device_to_host += rows.numel()

    # ---- up ---------------------------------------------------------------------------

    def restore(self, blocks: list[int], keys: list[bytes]) -> Restore:
        """Start filling device `blocks` with the K/V of `keys` (each in host RAM or on
        disk) beside the engine's steps."""
        self.save_evicted()  # the blocks given to us may be ones just evicted
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record()  # the copies out of those blocks come first
        host = self.host
        slots = [host.take(k) if host is not None and k in host else None for k in keys]
        restore = Restore(blocks, keys, slots)
        restore.future = self._worker.submit(self._fill, restore, ready)
        self._restores.append(restore)
        return restore

    def finish(self, restore: Restore) -> None:
        """Wait for a restore (cancelled first if asked) and count what it moved."""
        assert restore.future is not None
        restore.future.result()
        self._restores.remove(restore)
        for source in restore.sources:
            if source == "host":
                self.stats.host_to_device += self.cache.block_bytes
            else:
                self.stats.disk_to_device += self.cache.block_bytes

    def wait_any(self, timeout: float) -> None:
        """Block until a restore finishes, or `timeout` seconds (nothing else to do)."""
        pending = [r.future for r in self._restores if r.future is not None]
        if pending:
            concurrent.futures.wait(
                pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def _fill(self, restore: Restore, ready: Any) -> None:
        """On the worker thread: stage blocks on the device a chunk at a time and scatter
        each chunk into the cache; stop at a file that fails its checks."""
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._stream.wait_event(ready)
                    self._fill_chunks(restore)
            else:
                self._fill_chunks(restore)
        except Exception:  # what was filled stays good; the rest is computed
            log.exception("KV restore stopped after %d blocks", restore.num_loaded)
        finally:
            if self._stream is not None:
                self._stream.synchronize()
            for taken in restore.host_slots:
                if taken is not None:
                    assert self.host is not None
                    self.host.release(taken[0])

    def _fill_chunks(self, restore: Restore) -> None:
        staging = torch.empty(
            (min(RESTORE_CHUNK, len(restore.keys)), self.cache.block_bytes),
            dtype=torch.uint8,
            device=self.device,
        )
        n = 0  # blocks staged, not yet scattered
        for i, key in enumerate(restore.keys):
            if restore.cancelled or not self._stage(restore, i, key, staging[n]):
                break
            n += 1
            if n == len(staging):
                self._scatter(restore, staging, n)
                n = 0
        self._scatter(restore, staging, n)

    def _stage(self, restore: Restore, i: int, key: bytes, row: torch.Tensor) -> bool:
        taken = restore.host_slots[i]
        if taken is not None:
            assert self.host is not None
            slot, filled = taken
            if filled is not None and self._stream is not None:
                self._stream.wait_event(filled)
            row.copy_(self.host.slots[slot], non_blocking=True)
            restore.sources.append("host")
            return True
        data = self.disk.load(key) if self.disk is not None else None
        if data is None:
            return False  # gone or corrupt since the lookup: compute from here
        row.copy_(data)
        restore.sources.append("disk")
        return True

    def _scatter(self, restore: Restore, staging: torch.Tensor, n: int) -> None:
        if not n:
            return
        first = restore.num_loaded
        blocks = torch.tensor(restore.blocks[first : first + n], device=self.device)
        self.cache.scatter_blocks(blocks, staging[:n])
        restore.num_loaded += n
