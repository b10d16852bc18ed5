"""The host-RAM tier: KV blocks the accelerator evicted, kept in pinned host memory in
front of the disk tier, so a returning agent's context comes back over PCIe instead of
being recomputed or read from disk.

A block is on the device or here, not both: it moves here when the device evicts it and
moves back when a request reads it. Every block that arrives is also handed to the disk
tier (when there is one), so a slot can be reused for a newer block without losing the
older one, and the blocks outlive the process. Copies into a slot are queued without
waiting; the slot keeps the event that marks its copy done, and whoever reads the slot (the
disk writer, a restore) waits for that event first.

Only for discrete accelerators: on CPU and unified memory the device memory is host memory,
so there is no second copy to keep and blocks go straight to the disk tier.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from typing import Any

import torch

from kamado.kv.disk_tier import DiskTier


class HostTier:
    def __init__(
        self, capacity_bytes: int, block_bytes: int, pin: bool, disk: DiskTier | None
    ) -> None:
        self.num_slots = capacity_bytes // block_bytes
        # Pinning is slow (about 10 s for 16 GiB on an H200 host) but paid once, at start.
        self.slots = torch.empty((self.num_slots, block_bytes), dtype=torch.uint8, pin_memory=pin)
        self.disk = disk
        self._lock = threading.Lock()  # slots are released from the disk writer's thread
        self._slot_of: OrderedDict[bytes, int] = OrderedDict()  # least recently stored first
        self._key_at: list[bytes | None] = [None] * self.num_slots
        self._free = list(range(self.num_slots))
        self._readers = [0] * self.num_slots  # copies out of the slot still to finish
        self._events: list[Any] = [None] * self.num_slots  # marks the slot's fill done
        self._unwritten: deque[tuple[bytes, int]] = deque()  # filled, not yet given to disk
        self.num_evictions = 0  # blocks pushed out of host RAM for newer ones
        self.num_bypassed = 0  # device blocks that found every slot busy (went to disk)

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slot_of

    def claim(self, keys: list[bytes]) -> list[int | None]:
        """A slot for each block about to arrive (None: already here, or every slot is still
        being copied out); the oldest blocks make room, the disk tier holding them already."""
        self._hand_to_disk()
        slots: list[int | None] = []
        with self._lock:
            for key in keys:
                if key in self._slot_of:
                    slots.append(None)
                    continue
                slot = self._free.pop() if self._free else self._victim()
                self.num_bypassed += slot is None
                slots.append(slot)
        return slots

    def _victim(self) -> int | None:
        for key, slot in self._slot_of.items():
            if not self._readers[slot]:
                del self._slot_of[key]
                self._key_at[slot] = None
                self.num_evictions += 1
                return slot
        return None

    def filled(self, keys: list[bytes], slots: list[int], event: Any) -> None:
        """The copies into `slots` are queued; `event` (None on CPU) marks them done."""
        with self._lock:
            for key, slot in zip(keys, slots, strict=True):
                self._slot_of[key] = slot
                self._key_at[slot] = key
                self._events[slot] = event
                if self.disk is not None:
                    self._readers[slot] += 1  # until the disk writer has it
                    self._unwritten.append((key, slot))
        self._hand_to_disk()

    def take(self, key: bytes) -> tuple[int, Any]:
        """Move the block out (it is going back to the device): its slot and the event to
        wait for before reading it. The slot is reused after `release`."""
        with self._lock:
            slot = self._slot_of.pop(key)
            self._key_at[slot] = None
            self._readers[slot] += 1
            return slot, self._events[slot]

    def release(self, slot: int) -> None:
        """A copy out of the slot is done."""
        with self._lock:
            self._readers[slot] -= 1
            if not self._readers[slot] and self._key_at[slot] is None:
                self._free.append(slot)

    def _hand_to_disk(self) -> None:
        """Give the disk writer the blocks whose copies have landed (in order, so one slow
        copy holds back the rest: they were queued on one stream behind it)."""
        while self._unwritten:
            key, slot = self._unwritten[0]
            event = self._events[slot]
            if event is not None and not event.query():
                return
            self._unwritten.popleft()
            assert self.disk is not None
            self.disk.store(key, self.slots[slot], written=lambda slot=slot: self.release(slot))
