"""Fixed-size KV blocks: a free set with reference counts.

Placement keeps each sequence's blocks in one contiguous run, so attention can read its
K/V as a view instead of gathering it: a growing sequence takes the block right after
its last one, and a new sequence (or one whose next block is taken) starts in the middle
of the largest free gap, leaving the sequence before the gap room to grow too.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = set(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, after: int | None = None) -> int:
        """Take a free block: `after + 1` when free, else the middle of the largest gap."""
        if not self._free:
            raise OutOfBlocks("no free KV blocks")
        block = after + 1 if after is not None and after + 1 in self._free else self._runway()
        self._free.remove(block)
        self.ref_counts[block] = 1
        return block

    def _runway(self) -> int:
        # O(free blocks), paid only when a sequence starts or collides with a neighbour.
        free = sorted(self._free)
        best_start, best_len, run_start = free[0], 0, free[0]
        for prev, block in zip(free, free[1:] + [None], strict=True):
            if block != prev + 1:
                if prev + 1 - run_start > best_len:
                    best_start, best_len = run_start, prev + 1 - run_start
                if block is not None:
                    run_start = block
        # A gap at the very start has no sequence before it that might want to grow.
        return 0 if best_start == 0 else best_start + best_len // 2

    def share(self, block: int) -> None:
        """Another sequence now reads this block too."""
        assert self.ref_counts[block] > 0, "sharing a free block"
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        assert self.ref_counts[block] > 0, "releasing a free block"
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self._free.add(block)
