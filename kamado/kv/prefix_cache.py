"""Automatic prefix caching: a new sequence starts from the full blocks some earlier one
computed for the same leading tokens, on the device or restored from the disk tier.

Only full blocks are shared, and never the block holding a sequence's last token: at least
one token is computed so there are logits to sample from.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.kv.block_hash import extend_keys
from kamado.kv.block_pool import BlockPool
from kamado.kv.cache import KVCache
from kamado.kv.disk_tier import DiskTier
from kamado.kv.eviction import MAX_SESSIONS

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class PrefixMatch:
    device_blocks: list[int] = field(default_factory=list)  # cached on the device, in order
    disk_keys: list[bytes] = field(default_factory=list)  # the blocks after them, on disk
    num_unreferenced: int = 0  # device blocks nobody reads now: taking them uses free room

    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.disk_keys)


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up (once per request)
    device_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    disk_bytes_written: int = 0
    disk_bytes_read: int = 0
    # Turns whose prompt changed what the session's previous prompt said (history
    # rewritten by the chat template or the client), and the tokens that cost.
    history_rewrites: int = 0
    history_rewritten_tokens: int = 0


@dataclass
class SessionTurn:
    """A session's newest turn: the keys of its computed blocks, prompt blocks first."""

    keys: list[bytes]
    num_prompt_blocks: int


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        cache: KVCache,
        block_size: int,
        disk: DiskTier | None = None,
        enabled: bool = True,
    ) -> None:
        self.pool = pool
        self.cache = cache
        self.block_size = block_size
        self.disk = disk
        self.enabled = enabled
        self.stats = PrefixStats()
        self._newest: OrderedDict[str, SessionTurn] = OrderedDict()
        if disk is not None:
            pool.on_evict = self._save

    def match(self, seq: Sequence) -> PrefixMatch:
        """The cached leading blocks of `seq` (nothing is taken yet)."""
        found = PrefixMatch()
        if not self.enabled or seq.block_table:
            return found
        keys = seq.block_keys
        extend_keys(keys, seq.token_ids, (seq.num_tokens - 1) // self.block_size, self.block_size)
        for key in keys[: (seq.num_tokens - 1) // self.block_size]:
            block = self.pool.lookup(key)
            if block is not None and not found.disk_keys:
                found.device_blocks.append(block)
                found.num_unreferenced += self.pool.ref_counts[block] == 0
            elif block is None and self.disk is not None and key in self.disk:
                found.disk_keys.append(key)
            else:
                break
        return found

    def acquire(self, seq: Sequence, found: PrefixMatch) -> None:
        """Give `seq` the matched blocks (restoring those on disk) and skip their tokens."""
        self.pool.evictable.touch(seq.session)
        for block in found.device_blocks:
            self.pool.reuse(block)
            seq.block_table.append(block)
        device_tokens = len(seq.block_table) * self.block_size
        for key in found.disk_keys:
            data = self.disk.load(key) if self.disk is not None else None
            if data is None:
                break  # the file went bad since the lookup: compute from here
            block = self.pool.allocate(after=seq.block_table[-1] if seq.block_table else None)
            self.cache.write_block(block, data)
            self.pool.set_key(block, key)
            seq.block_table.append(block)
            self.stats.disk_bytes_read += data.numel() * data.element_size()
        cached = len(seq.block_table) * self.block_size
        seq.num_computed = cached
        if seq.num_cached_tokens is None:  # a recomputation after preemption is not a new query
            seq.num_cached_tokens = cached
            self.stats.queried_tokens += seq.num_prompt_tokens
            self.stats.device_hit_tokens += device_tokens
            self.stats.disk_hit_tokens += cached - device_tokens
            self._check_history(seq)

    def _check_history(self, seq: Sequence) -> None:
        """An agent's next prompt should begin with its previous prompt. Where it differs
        inside it, something rewrote the history (a chat template that drops past reasoning,
        a client that edits old messages) and that part is recomputed: count it."""
        previous = self._newest.get(seq.session) if seq.session is not None else None
        if previous is None or seq.index != 0:
            return
        comparable = min(previous.num_prompt_blocks, len(seq.block_keys))
        same = 0
        while same < comparable and seq.block_keys[same] == previous.keys[same]:
            same += 1
        if same == comparable or same == 0:
            return  # history kept, or another conversation under the same key
        lost = (comparable - same) * self.block_size
        if not self.stats.history_rewrites:
            log.warning(
                "session %r: this turn's prompt differs from the previous one's %d tokens "
                "from the start, so %d tokens of history were recomputed; the chat template "
                "or the client rewrites earlier turns (kamado_prefix_history_rewrites_total)",
                seq.session,
                same * self.block_size,
                lost,
            )
        self.stats.history_rewrites += 1
        self.stats.history_rewritten_tokens += lost

    def commit(self, seq: Sequence, num_computed_before: int) -> None:
        """Blocks that this step filled with computed K/V become findable by their key."""
        if not self.enabled:
            return
        num_full = seq.num_computed // self.block_size
        extend_keys(seq.block_keys, seq.token_ids, num_full, self.block_size)
        for b in range(num_computed_before // self.block_size, num_full):
            block, key = seq.block_table[b], seq.block_keys[b]
            self.pool.set_key(block, key)
            if self.disk is not None and self.pool.key_of.get(block) == key:
                self._save(block, key)

    def release(self, seq: Sequence) -> None:
        """The sequence lets go of its blocks; full ones stay cached, owned by its session."""
        for depth, block in enumerate(seq.block_table):
            self.pool.release(block, seq.session, depth)
        seq.block_table = []

    def end_turn(self, seq: Sequence) -> None:
        """The sequence's turn is over: its chain is now its session's newest; blocks only
        the session's previous turn read are evicted first."""
        self.pool.evictable.touch(seq.session)
        if not self.enabled or seq.session is None or seq.index != 0:
            return
        chain = seq.block_keys[: seq.num_computed // self.block_size]
        if not chain:
            return  # ended before computing anything (e.g. aborted in the queue)
        current = set(chain)
        previous = self._newest.get(seq.session)
        for key in previous.keys if previous is not None else []:
            if key not in current:
                self.pool.supersede(key)
        self._newest[seq.session] = SessionTurn(chain, seq.num_prompt_tokens // self.block_size)
        self._newest.move_to_end(seq.session)
        if len(self._newest) > MAX_SESSIONS:
            self._newest.popitem(last=False)

    def _save(self, block: int, key: bytes) -> None:
        """Keep a block's K/V on disk: written through when the block fills (on CPU and
        unified memory a file write is cheap, and the tier then survives a crash), and again
        before eviction if the disk tier has dropped it meanwhile."""
        assert self.disk is not None
        if key not in self.disk:
            self.stats.disk_bytes_written += self.disk.store(key, self.cache.read_block(block))
