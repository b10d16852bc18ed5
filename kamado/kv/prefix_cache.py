"""Automatic prefix caching: a new sequence starts from the full blocks some earlier one
computed for the same leading tokens, on the device or brought back from host RAM or disk
(kv/tier_transfers.py) before it runs, then from a copy of a cached block that begins with
its next tokens (kv/block_tokens.py).

Full blocks are shared; a block is copied where only its first tokens match (the rest
will differ). The prompt's last token is always computed, so there are logits to sample.
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.kv.block_hash import ROOT, extend_keys
from kamado.kv.block_pool import BlockPool
from kamado.kv.block_tokens import BlockTokens, TokenMatch, partial_block_key
from kamado.kv.cache import KVCache
from kamado.kv.eviction import MAX_SESSIONS
from kamado.kv.tier_transfers import TierTransfers

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

log = logging.getLogger(__name__)
# Sessions whose newest turn's tokens are kept (8 bytes a token), so that their next turn
# takes its block keys instead of hashing the same tokens again.
TOKENS_KEPT_SESSIONS = 32


@dataclass
class PrefixMatch:
    device_blocks: list[int] = field(default_factory=list)  # cached on the device, in order
    lower_keys: list[bytes] = field(default_factory=list)  # the blocks after them, below
    num_unreferenced: int = 0  # device blocks nobody reads now: taking them uses free room
    partial: TokenMatch | None = None  # a block to copy the first tokens of, after them all
    # A running sequence prefilling the block after them: waiting for it to be computed
    # costs less than computing it twice (agents starting at once share a system prompt).
    computing: Sequence | None = None

    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.lower_keys)

    def num_tokens(self, block_size: int) -> int:
        return self.num_blocks() * block_size + (self.partial.num_tokens if self.partial else 0)


@dataclass
class PrefixStats:
    queried_tokens: int = 0  # prompt tokens looked up (once per request)
    device_hit_tokens: int = 0
    partial_hit_tokens: int = 0  # the part of device hits copied from inside a block
    host_hit_tokens: int = 0
    disk_hit_tokens: int = 0
    # Turns whose prompt changed what the session's previous prompt said (history
    # rewritten by the chat template or the client), and the tokens that cost.
    history_rewrites: int = 0
    history_rewritten_tokens: int = 0


@dataclass
class SessionTurn:
    """A session's newest turn: the keys of its computed blocks, prompt blocks first."""

    keys: list[bytes]
    num_prompt_blocks: int
    partial_key: bytes | None = None  # the partly filled block it left behind


class PrefixCache:
    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        transfers: TierTransfers | None = None,
        enabled: bool = True,
        cache: KVCache | None = None,  # where partly matched blocks are copied; None: not
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.transfers = transfers
        self.enabled = enabled
        self.cache = cache
        self.stats = PrefixStats()
        self._newest: OrderedDict[str, SessionTurn] = OrderedDict()
        # The tokens of those turns' chains (int64), for the most recent sessions only.
        self._newest_tokens: OrderedDict[str, bytes] = OrderedDict()
        # Full prompt blocks that running sequences have yet to compute, by key.
        self._in_flight: dict[bytes, Sequence] = {}
        self.block_tokens = BlockTokens(block_size)
        pool.notify_evictions(self._evicted)

    def match(self, seq: Sequence) -> PrefixMatch:
        """The cached leading blocks of `seq` (nothing is taken yet)."""
        found = PrefixMatch()
        if not self.enabled or seq.block_table:
            return found
        keys = seq.block_keys
        self._reuse_keys(seq)
        # Keys are made as the walk needs them: a new prompt hashes up to its first miss,
        # not every block in the engine loop (its commits key the rest as they are computed).
        for b in range((seq.num_tokens - 1) // self.block_size):
            extend_keys(keys, seq.token_ids, b + 1, self.block_size)
            key = keys[b]
            block = self.pool.lookup(key)
            if block is not None and not found.lower_keys:
                found.device_blocks.append(block)
                found.num_unreferenced += self.pool.ref_counts[block] == 0
            elif block is None and self.transfers is not None and key in self.transfers:
                found.lower_keys.append(key)
            else:
                found.computing = self._in_flight.get(key)
                break
        self._match_partial(seq, found)
        return found

    def _reuse_keys(self, seq: Sequence) -> None:
        """An agent's next prompt begins with its previous turn: take that turn's block keys
        where the tokens are the same, rather than hash them again in the engine loop (about
        a microsecond a block, so milliseconds for a long agent context). Its whole chain if
        the prompt repeats the reply too, else its prompt's blocks, else none."""
        if seq.block_keys or seq.session is None:
            return
        turn, tokens = self._newest.get(seq.session), self._newest_tokens.get(seq.session)
        if turn is None or tokens is None:
            return
        for num_blocks in (len(turn.keys), turn.num_prompt_blocks):
            num_tokens = num_blocks * self.block_size
            if 0 < num_tokens <= seq.num_tokens and (
                array("q", seq.token_ids[:num_tokens]).tobytes() == tokens[: 8 * num_tokens]
            ):
                seq.block_keys.extend(turn.keys[:num_blocks])
                return

    def _match_partial(self, seq: Sequence, found: PrefixMatch) -> None:
        """After the matched full blocks: a cached block whose first tokens are the next
        ones of `seq`, short of its last token."""
        if self.cache is None:
            return
        start = found.num_blocks() * self.block_size
        wanted = seq.token_ids[start : min(start + self.block_size, seq.num_tokens) - 1]
        parent = seq.block_keys[found.num_blocks() - 1] if found.num_blocks() else ROOT
        found.partial = self.block_tokens.longest(parent, wanted) if wanted else None
        if found.partial is not None:
            # Pinned from acquire until copied: room it holds, like the matched blocks.
            found.num_unreferenced += self.pool.ref_counts[found.partial.block] == 0

    def acquire(self, seq: Sequence, found: PrefixMatch) -> None:
        """Give `seq` the matched device blocks and skip their tokens; blocks found below
        start coming back (`seq.restore`), and the sequence waits for `finish_restore`."""
        self.pool.evictable.touch(seq.session)
        for block in found.device_blocks:
            self.pool.reuse(block)
            seq.block_table.append(block)
        seq.num_computed = len(seq.block_table) * self.block_size
        seq.partial = found.partial
        if found.partial is not None:
            self.pool.reuse(found.partial.block)  # pinned: allocations may not evict it
        self._mark_in_flight(seq, len(seq.block_table) + len(found.lower_keys))
        if found.lower_keys:
            assert self.transfers is not None
            blocks = []
            for _ in found.lower_keys:
                after = seq.block_table[-1] if seq.block_table else None
                blocks.append(self.pool.allocate(after=after))
                seq.block_table.append(blocks[-1])
            seq.restore = self.transfers.restore(blocks, found.lower_keys)
        else:
            self._copy_partial(seq)
            self._count_hits(seq, {})

    def _mark_in_flight(self, seq: Sequence, first: int) -> None:
        """Full prompt block `first` is this sequence's to compute next. Only that one is
        filed: a sequence with the same prompt misses its cache lookup there first, and
        waits (commit files the next block as each one is computed)."""
        if not self.enabled or first >= seq.num_prompt_tokens // self.block_size:
            return
        extend_keys(seq.block_keys, seq.token_ids, first + 1, self.block_size)
        self._in_flight.setdefault(seq.block_keys[first], seq)

    def _clear_in_flight(self, seq: Sequence, keys: list[bytes]) -> None:
        for key in keys:
            if self._in_flight.get(key) is seq:
                del self._in_flight[key]

    def finish_restore(self, seq: Sequence) -> None:
        """The restore of `seq` ended: its filled blocks become findable and count as
        computed; blocks after a failed read go back to the pool."""
        restore = seq.restore
        assert restore is not None and self.transfers is not None
        self.transfers.finish(restore)
        seq.restore = None
        for block, key in zip(restore.blocks[: restore.num_loaded], restore.keys, strict=False):
            self.pool.set_key(block, key)
        num_blocks = len(seq.block_table) - len(restore.blocks) + restore.num_loaded
        self.pool.shrink(seq.block_table, num_blocks * self.block_size, self.block_size)
        seq.num_computed = num_blocks * self.block_size
        self._copy_partial(seq, whole_chain=restore.num_loaded == len(restore.blocks))
        self._count_hits(seq, Counter(restore.sources))

    def _copy_partial(self, seq: Sequence, whole_chain: bool = True) -> None:
        """Append a copy of the partly matched block (the sequence writes its own tokens
        after the shared ones) and skip those tokens; not when a lower-tier block failed
        to come back, which ends the chain before the copy's parent, nor when others took
        every block while the sequence waited for its restore."""
        match, seq.partial = seq.partial, None
        if match is None:
            return
        depth = len(seq.block_table)
        if whole_chain and self.pool.num_free > 0:
            assert self.cache is not None
            copy = self.pool.allocate(after=seq.block_table[-1] if seq.block_table else None)
            if self.transfers is not None:
                self.transfers.save_evicted()  # the copy may land in a block just evicted
            # Every KV format scales per token or per layer, never per block: the copied
            # tokens stay exact as the sequence overwrites the rest of the block.
            self.cache.copy_block(match.block, copy)
            seq.block_table.append(copy)
            seq.num_computed += match.num_tokens
            if seq.num_cached_tokens is None:  # counted once a request, as in _count_hits
                self.stats.partial_hit_tokens += match.num_tokens
        # The pin of acquire; left unreferenced, the block is now owned by this session.
        self.pool.release(match.block, seq.session, depth)

    def _count_hits(self, seq: Sequence, restored: Mapping[str, int]) -> None:
        if seq.num_cached_tokens is not None:
            return  # a recomputation after preemption is not a new query
        seq.num_cached_tokens = seq.num_computed
        host = restored.get("host", 0) * self.block_size
        disk = restored.get("disk", 0) * self.block_size
        self.stats.queried_tokens += seq.num_prompt_tokens
        self.stats.device_hit_tokens += seq.num_computed - host - disk  # partial included
        self.stats.host_hit_tokens += host
        self.stats.disk_hit_tokens += disk
        self._check_history(seq)

    def _check_history(self, seq: Sequence) -> None:
        """An agent's next prompt should begin with its previous prompt. Where it differs
        inside it, something rewrote the history (a chat template that drops past reasoning,
        a client that edits old messages) and that part is recomputed: count it."""
        previous = self._newest.get(seq.session) if seq.session is not None else None
        if previous is None or seq.index != 0:
            return
        # The blocks a lookup compares: all full ones but the one holding the last token.
        comparable = min(previous.num_prompt_blocks, (seq.num_tokens - 1) // self.block_size)
        extend_keys(seq.block_keys, seq.token_ids, comparable, self.block_size)
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
        first = num_computed_before // self.block_size
        for b in range(first, num_full):
            block, key = seq.block_table[b], seq.block_keys[b]
            self.pool.set_key(block, key)
            if self.pool.key_of.get(block) != key:
                continue  # computed twice at once: the other block is the cached one
            tokens = seq.token_ids[b * self.block_size : (b + 1) * self.block_size]
            self.block_tokens.add(block, seq.block_keys[b - 1] if b else ROOT, tokens)
            if self.transfers is not None:
                self.transfers.filled(block, key)
        self._clear_in_flight(seq, seq.block_keys[first:num_full])
        self._mark_in_flight(seq, num_full)

    def release(self, seq: Sequence) -> None:
        """The sequence lets go of its blocks; full ones and the computed part of a partly
        filled last one stay cached, owned by its session. A restore still running is
        stopped first: its blocks are being written."""
        if seq.restore is not None:
            seq.restore.cancelled = True
            self.finish_restore(seq)
        self._keep_partial(seq)
        self._clear_in_flight(seq, seq.block_keys)
        self.pool.release_chain(seq.block_table, seq.session)
        seq.block_table = []

    def _partial_tail(self, seq: Sequence) -> tuple[bytes, list[int]] | None:
        """The parent key and the computed tokens of the sequence's partly filled block."""
        num_full, num_partial = divmod(seq.num_computed, self.block_size)
        if not self.enabled or not num_partial:
            return None
        extend_keys(seq.block_keys, seq.token_ids, num_full, self.block_size)
        parent = seq.block_keys[num_full - 1] if num_full else ROOT
        return parent, seq.token_ids[num_full * self.block_size : seq.num_computed]

    def _keep_partial(self, seq: Sequence) -> None:
        """Key the partly filled block, so that it stays cached and findable by its tokens."""
        tail = self._partial_tail(seq)
        if tail is None or len(seq.block_table) * self.block_size <= seq.num_computed:
            return  # nothing computed past the full blocks, or no block holds it
        block, key = seq.block_table[seq.num_computed // self.block_size], partial_block_key(*tail)
        self.pool.set_key(block, key)
        if self.pool.key_of.get(block) == key:  # not kept twice: another copy holds it already
            self.block_tokens.add(block, *tail)

    def end_turn(self, seq: Sequence) -> None:
        """The sequence's turn is over: its chain is now its session's newest; blocks only
        the session's previous turn read are evicted first."""
        self.pool.evictable.touch(seq.session)
        if not self.enabled or seq.session is None or seq.index != 0:
            return
        chain = seq.block_keys[: seq.num_computed // self.block_size]
        if not chain:
            return  # ended before computing anything (e.g. aborted in the queue)
        tail = self._partial_tail(seq)
        partial_key = partial_block_key(*tail) if tail is not None else None
        current = {*chain, partial_key}
        previous = self._newest.get(seq.session)
        for key in [*previous.keys, previous.partial_key] if previous is not None else []:
            if key is not None and key not in current:
                self.pool.supersede(key)
        # A turn aborted inside its prefill computed only part of its prompt.
        num_prompt_blocks = min(len(chain), seq.num_prompt_tokens // self.block_size)
        self._newest[seq.session] = SessionTurn(chain, num_prompt_blocks, partial_key)
        self._newest.move_to_end(seq.session)
        if len(self._newest) > MAX_SESSIONS:
            self._newest.popitem(last=False)
        self._newest_tokens[seq.session] = array(
            "q", seq.token_ids[: len(chain) * self.block_size]
        ).tobytes()
        self._newest_tokens.move_to_end(seq.session)
        if len(self._newest_tokens) > TOKENS_KEPT_SESSIONS:
            self._newest_tokens.popitem(last=False)

    def _evicted(self, block: int, key: bytes) -> None:
        """A cached block's slot is taken for new content. A partly filled block is not
        kept below the device: the tiers are addressed by full-block keys, and a partial
        block saves less than one block of compute, not worth a copy per turn."""
        was_partial = self.block_tokens.forget(block)
        if self.transfers is not None and not was_partial:
            self.transfers.evicting(block, key)
