"""Fixed-size KV blocks: a free list with reference counts.

Blocks are handed out lowest-id first, and a sequence growing by one block gets the
block right after its last one when that is free, so most sequences occupy one
contiguous run of slots and attention can read their K/V without a gather.
"""

from __future__ import annotations

import heapq


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = set(range(num_blocks))
        self._heap = list(range(num_blocks))  # may hold stale ids; _free is the truth

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, after: int | None = None) -> int:
        """Take a free block, preferring `after + 1` so runs stay contiguous."""
        if not self._free:
            raise OutOfBlocks("no free KV blocks")
        if after is not None and after + 1 in self._free:
            block = after + 1
        else:
            block = heapq.heappop(self._heap)
            while block not in self._free:
                block = heapq.heappop(self._heap)
        self._free.remove(block)
        self.ref_counts[block] = 1
        return block

    def share(self, block: int) -> None:
        """Another sequence now reads this block too."""
        assert self.ref_counts[block] > 0, "sharing a free block"
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, "releasing a free block"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.add(block)
            heapq.heappush(self._heap, block)
            if len(self._heap) > 2 * self.num_blocks:  # drop stale entries now and then
                self._heap = sorted(self._free)
