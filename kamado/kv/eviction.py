"""Which unreferenced cached block to reuse first, knowing about agent sessions.

Order, first evicted first: blocks of branches a session's newer turn superseded; then by
how recently the owning session was active (idle sessions age out before active ones;
a block without a session counts as active when it was released); within a session, the
deepest block first, so what remains is still a usable prefix.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

MAX_SESSIONS = 1024  # sessions remembered; the least recently active are forgotten


class EvictionOrder:
    def __init__(self) -> None:
        self._clock = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> last active tick
        # Evictable blocks: block -> (session or None, depth, release tick).
        self._blocks: dict[int, tuple[str | None, int, int]] = {}
        self._superseded: set[int] = set()
        self._heap: list[tuple[tuple[int, int, int], int]] = []

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def touch(self, session: str | None) -> None:
        """The session is active now (a turn arrived or finished)."""
        self._clock += 1
        if session is not None:
            self._sessions[session] = self._clock
            self._sessions.move_to_end(session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def add(self, block: int, session: str | None, depth: int) -> None:
        self.add_chain([(block, depth)], session)

    def add_chain(self, blocks: list[tuple[int, int]], session: str | None) -> None:
        """(block, depth) of one session, released in this order (a sequence's table at
        its end), each at its own tick as `add` would. In one loop, with the session's
        activity read once: a turn of 100k tokens releases thousands of blocks in the
        engine loop."""
        active = self._sessions.get(session) if session is not None else None
        # A block being released is not superseded: `remove` cleared that when it was read.
        for block, depth in blocks:
            self._clock += 1
            self._blocks[block] = (session, depth, self._clock)
            priority = _rank(False, self._clock if active is None else active, depth)
            heapq.heappush(self._heap, (priority, block))
        if len(self._heap) > 4 * len(self._blocks) + 64:  # drop entries of reused blocks
            self._heap = [(self._priority(b), b) for b in self._blocks]
            heapq.heapify(self._heap)

    def remove(self, block: int) -> None:
        """The block is read again: it is no longer evictable (nor superseded)."""
        del self._blocks[block]
        self._superseded.discard(block)

    def supersede(self, block: int) -> None:
        if block in self._blocks and block not in self._superseded:
            self._superseded.add(block)
            heapq.heappush(self._heap, (self._priority(block), block))

    def pop(self) -> int:
        # Entries go stale as sessions become active again: re-file them at their priority now.
        while True:
            priority, block = heapq.heappop(self._heap)
            if block not in self._blocks:
                continue
            now = self._priority(block)
            if now != priority:
                heapq.heappush(self._heap, (now, block))
                continue
            self.remove(block)
            return block

    def _priority(self, block: int) -> tuple[int, int, int]:
        session, depth, released = self._blocks[block]
        active = self._sessions.get(session, released) if session is not None else released
        return _rank(block in self._superseded, active, depth)


def _rank(superseded: bool, active: int, depth: int) -> tuple[int, int, int]:
    """Heap order, first evicted first: superseded, then the least recently active, then
    the deepest."""
    return (0 if superseded else 1, active, -depth)
