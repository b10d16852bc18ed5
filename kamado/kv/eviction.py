"""Which unreferenced cached block to reuse first, knowing about agent sessions.

Order, first evicted first: blocks of branches a session's newer turn superseded; then by
how recently the owning session was active (idle sessions age out before active ones;
a block without a session counts as active when it was released); within a session, the
deepest block first, so what remains is still a usable prefix.

Blocks released together (a sequence's table when it ends) are filed as one run, in the
order they go, under one heap entry: a turn of 131k tokens releases 8k blocks, and a heap
entry each took 12 ms of the engine loop, a stall of every stream beside it. A block read
again leaves its run's list as a stale entry, skipped when the run gets there; a run
mostly stale is compacted, so the lists stay within a few times the evictable blocks.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

MAX_SESSIONS = 1024  # sessions remembered; the least recently active are forgotten
COMPACT_BELOW = 4  # a run is compacted once fewer than 1 in this many entries are live

Priority = tuple[int, int, int]
# An evictable block's (session or None, depth, release tick, run): a plain tuple, as a
# NamedTuple took three times as long to make, thousands at a time.
Record = tuple["str | None", int, int, "_Run"]


class _Run:
    """Blocks released together, in the order they go. A block's entry counts while its
    record names this run: one read and released again since belongs to a newer run."""

    __slots__ = ("blocks", "live", "next")

    def __init__(self, blocks: list[int]) -> None:
        self.blocks = blocks
        self.next = 0  # entries before it were evicted or found stale
        self.live = len(blocks)  # entries that count


class EvictionOrder:
    def __init__(self) -> None:
        self._clock = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()  # session -> last active tick
        self._blocks: dict[int, Record] = {}  # the evictable blocks
        self._superseded: set[int] = set()
        self._runs: list[tuple[Priority, int, _Run]] = []  # heap by each run's next block
        self._superseded_heap: list[tuple[Priority, int]] = []
        self._serial = itertools.count()  # ties between runs: the older first
        self._dead_runs = 0  # runs that lost their last live entry since the heap was pruned

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
        its end), each at its own tick as `add` would, as one run."""
        if not blocks:
            return
        first = self._clock + 1
        self._clock += len(blocks)
        # A known session's blocks go deepest first: the run is the chain reversed. Others
        # go in release order, each at its own tick. (A session forgotten later, past
        # MAX_SESSIONS, keeps its runs deepest first, where its ticks alone would say the
        # other way round: within one release, so no other block falls between them.)
        in_order = [block for block, _ in blocks]
        run = _Run(in_order[::-1] if session in self._sessions else in_order)
        # A block being released is not superseded: `remove` cleared that when it was read.
        for tick, (block, depth) in enumerate(blocks, first):
            self._blocks[block] = (session, depth, tick, run)
        self._push(run)
        if self._dead_runs > len(self._runs) // 2 + 64:  # drop runs nothing is left of
            self._runs = [entry for entry in self._runs if entry[2].live]
            heapq.heapify(self._runs)
            self._dead_runs = 0

    def remove(self, block: int) -> None:
        """The block is read again: it is no longer evictable (nor superseded)."""
        run = self._blocks.pop(block)[3]
        self._superseded.discard(block)
        run.live -= 1
        if run.live == 0:
            run.blocks, run.next = [], 0  # its heap entry finds it empty
            self._dead_runs += 1
        elif run.live * COMPACT_BELOW < len(run.blocks) - run.next:
            self._compact(run)

    def supersede(self, block: int) -> None:
        if block in self._blocks and block not in self._superseded:
            self._superseded.add(block)
            heap = self._superseded_heap
            heapq.heappush(heap, (self._priority(block), block))
            if len(heap) > 2 * len(self._superseded) + 64:  # drop entries of blocks read
                self._superseded_heap = [(self._priority(b), b) for b in self._superseded]
                heapq.heapify(self._superseded_heap)

    def pop(self) -> int:
        block = self._pop_superseded()
        if block is None:
            block = self._pop_run()
        self.remove(block)
        return block

    def _pop_superseded(self) -> int | None:
        """The first superseded block, which goes before any other; None if there is none."""
        heap = self._superseded_heap
        while heap:
            priority, block = heap[0]
            if block not in self._superseded:
                heapq.heappop(heap)  # read again since
            elif (now := self._priority(block)) != priority:
                heapq.heapreplace(heap, (now, block))  # its session was active since
            else:
                heapq.heappop(heap)
                return block
        return None

    def _pop_run(self) -> int:
        # Entries go stale as sessions become active again: re-file them at their priority now.
        while True:
            priority, serial, run = self._runs[0]
            block = self._head(run)
            if block is None:
                heapq.heappop(self._runs)
            elif (now := self._priority(block)) != priority:
                heapq.heapreplace(self._runs, (now, serial, run))
            else:
                run.next += 1
                heapq.heappop(self._runs)
                if self._head(run) is not None:
                    self._push(run)
                return block

    def _push(self, run: _Run) -> None:
        block = self._head(run)
        assert block is not None
        heapq.heappush(self._runs, (self._priority(block), next(self._serial), run))

    def _head(self, run: _Run) -> int | None:
        """The run's next block that still counts; None if none does."""
        while run.next < len(run.blocks):
            block = run.blocks[run.next]
            record = self._blocks.get(block)
            if record is not None and record[3] is run:
                return block
            run.next += 1
        return None

    def _compact(self, run: _Run) -> None:
        blocks = self._blocks
        run.blocks = [
            b for b in run.blocks[run.next :] if (r := blocks.get(b)) is not None and r[3] is run
        ]
        run.next = 0

    def _priority(self, block: int) -> Priority:
        session, depth, released, _ = self._blocks[block]
        active = self._sessions.get(session, released) if session is not None else released
        return _rank(block in self._superseded, active, depth)


def _rank(superseded: bool, active: int, depth: int) -> Priority:
    """Heap order, first evicted first: superseded, then the least recently active, then
    the deepest."""
    return (0 if superseded else 1, active, -depth)
