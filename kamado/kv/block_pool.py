"""Fixed-size KV blocks: reference counts, and full blocks kept as a prefix cache.

A block is free (holds nothing worth keeping), referenced by one or more sequences, or
cached: unreferenced but holding the K/V of a known prefix (its content key), so a later
request with the same prefix can read it again. Cached blocks are reused for new content
only when no free block is left, in the session-aware order of `EvictionOrder`.

Placement keeps each sequence's blocks in one contiguous run, so attention can read its
K/V as a view instead of gathering it: a growing sequence takes the block right after
its last one, and a new sequence (or one whose next block is taken) starts in the middle
of the largest free gap, leaving the sequence before the gap room to grow too.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from kamado.kv.eviction import EvictionOrder


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free blocks as a mask: runs of free blocks are found without sorting them.
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free_blocks = num_blocks
        self.evictable = EvictionOrder()
        self.key_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self._on_evict: weakref.WeakMethod | None = None
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out: free ones, and cached ones nobody reads."""
        return self._num_free_blocks + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.evictable)

    def allocate(self, after: int | None = None) -> int:
        """Take a free block: `after + 1` when free, else the middle of the largest gap;
        with no free block left, the first cached block in eviction order."""
        if self._num_free_blocks:
            nxt = -1 if after is None else after + 1
            block = nxt if 0 <= nxt < self.num_blocks and self._is_free[nxt] else self._runway()
            self._is_free[block] = False
            self._num_free_blocks -= 1
        elif self.evictable:
            block = self._evict()
        else:
            raise OutOfBlocks("no free KV blocks")
        self.ref_counts[block] = 1
        return block

    def grow(self, table: list[int], num_tokens: int, block_size: int) -> bool:
        """Append blocks to a sequence's `table` until it holds `num_tokens` tokens; False
        (taking nothing) when not enough blocks are free."""
        needed = max(0, -(-num_tokens // block_size) - len(table))
        if needed > self.num_free:
            return False
        for _ in range(needed):
            table.append(self.allocate(after=table[-1] if table else None))
        return True

    def shrink(self, table: list[int], num_tokens: int, block_size: int) -> None:
        """Release the blocks of `table` past the first `num_tokens` tokens."""
        keep = -(-num_tokens // block_size)
        while len(table) > keep:
            self.release(table.pop())

    def _runway(self) -> int:
        # Paid only when a sequence starts or collides with a neighbour; vectorized, since
        # a large KV budget has hundreds of thousands of blocks.
        edges = np.diff(self._is_free.view(np.int8), prepend=0, append=0)
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        longest = int(np.argmax(ends - starts))  # the first of the longest runs
        best_start, best_len = int(starts[longest]), int(ends[longest] - starts[longest])
        # A gap at the very start has no sequence before it that might want to grow.
        return 0 if best_start == 0 else best_start + best_len // 2

    def _evict(self) -> int:
        block = self.evictable.pop()
        key = self.key_of.pop(block)
        del self._block_of[key]
        self.num_evictions += 1
        listener = self._on_evict() if self._on_evict is not None else None
        if listener is not None:
            listener(block, key)
        return block

    def notify_evictions(self, method: Callable[[int, bytes], None]) -> None:
        """Call `method(block, key)` just before a cached block is overwritten. Held weakly:
        its owner (the prefix cache) holds this pool, and the engine's objects must be freed
        by reference counts alone, since the engine freezes the garbage collector."""
        self._on_evict = weakref.WeakMethod(method)

    def share(self, block: int) -> None:
        """Another sequence now reads this block too."""
        assert self.ref_counts[block] > 0, "sharing a free block"
        self.ref_counts[block] += 1

    def release(self, block: int, session: str | None = None, depth: int = 0) -> None:
        """One reader is done; a keyed block stays cached (owned by `session`, at `depth`
        in its chain) until its slot is needed."""
        self.release_chain([block], session, depth)

    def release_chain(
        self, blocks: list[int], session: str | None = None, first_depth: int = 0
    ) -> None:
        """A reader is done with each of `blocks`, a chain from depth `first_depth` on (a
        sequence's table): as `release`, in one pass."""
        ref_counts, key_of = self.ref_counts, self.key_of
        cached: list[tuple[int, int]] = []
        freed: list[int] = []
        for depth, block in enumerate(blocks, first_depth):
            count = ref_counts[block]
            assert count > 0, "releasing a free block"
            ref_counts[block] = count - 1
            if count == 1:
                if block in key_of:
                    cached.append((block, depth))
                else:
                    freed.append(block)
        self._is_free[freed] = True
        self._num_free_blocks += len(freed)
        self.evictable.add_chain(cached, session)

    # ---- the prefix cache: blocks by content key ----------------------------------------

    def lookup(self, key: bytes) -> int | None:
        return self._block_of.get(key)

    def reuse(self, block: int) -> None:
        """A sequence reads a cached block (referenced already, or waiting to be evicted)."""
        if self.ref_counts[block] == 0:
            self.evictable.remove(block)
        self.ref_counts[block] += 1

    def set_key(self, block: int, key: bytes) -> None:
        """The block now holds the full K/V of the prefix named `key`. A key cached in
        another block already (computed twice at once) keeps that block."""
        if key not in self._block_of and block not in self.key_of:
            self.key_of[block] = key
            self._block_of[key] = block

    def supersede(self, key: bytes) -> None:
        """A newer turn of the block's session no longer reads it: evict it early."""
        block = self._block_of.get(key)
        if block is not None:
            self.evictable.supersede(block)
