"""Continuous batching: which sequences run in the next step, and how many tokens each.

Every step carries all running decodes first; prefill (chunked) fills what is left of
the token budget, paced so decodes are never frozen. Beside decodes, a long prompt goes
a few layers per step: one chunk of it at a time runs through the layers the pacer
allows, and its tokens count as computed once the last layer is done. An agent's short
follow-up turn goes through every layer at once. With nothing decoding, a waiting short
turn is admitted ahead of the prompts being prefilled, in a step of its own, rather than
after their last chunk; and where the host's clock times each layer (a CPU, `alone_step_s`)
a long prompt's chunk goes by layers in steps of about that many seconds, so a request
that arrives meanwhile waits for no more than that. A new sequence starts from
whatever leading blocks the prefix cache holds for it. When KV blocks run out, the
newest sequence is preempted: its blocks are freed (full ones stay cached), a chunk part
way through its layers is dropped, and it is recomputed later from its tokens, ahead of
new arrivals. New arrivals are admitted session by session (the one running least goes
first), so one agent's burst cannot starve the others. One whose cached prefix continues
in host RAM or on disk waits, holding the blocks being filled, while the others run, and
goes first once they are back; one whose next prompt block another sequence is
prefilling right now waits for it to be computed, not to compute it twice.

With speculation, a decoding sequence also carries the draft tokens the speculator
planned for it, verified in the same step, where free blocks allow: a draft never
preempts anyone, and takes at most half the token budget left while prompts wait.
Blocks beyond the accepted tokens are given back after the step.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from kamado.engine.pacer import PrefillPacer
from kamado.engine.sequence import Sequence, StagedChunk, Status
from kamado.kv.block_pool import BlockPool
from kamado.kv.prefix_cache import PrefixCache
from kamado.spec.speculator import Speculator

# With nothing decoding, how long a short turn's restore may hold up the step: its few
# blocks come back from host RAM or disk in milliseconds, where the step would otherwise
# go to a whole chunk of the long prompts and the turn would wait for the next one.
SHORT_TURN_RESTORE_WAIT_S = 0.05


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # tokens computed this step, drafts included
    draft: list[int] = field(default_factory=list)  # verified after the sequence's tokens
    # A staged chunk's layers run this step (its seq.staged); None: every layer at once.
    layers: range | None = None
    completes: bool = True  # the tokens have been through every layer after this step
    # Seconds a staged chunk's layers may add to the step: where the host's clock measures
    # them (a CPU), they stop early once used, and `layers` (and `completes`) tell what ran.
    slack_s: float | None = None
    counted: bool = False  # its tokens count as computed (see EngineCore._count_computed)

    @property
    def samples(self) -> bool:
        """The step reaches the sequence's last token, so a next token is sampled."""
        return self.completes and self.num_new - len(self.draft) == self.seq.num_uncomputed


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        prefix: PrefixCache,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        pacer: PrefillPacer,
        num_layers: int,
        speculator: Speculator | None = None,
        alone_step_s: float | None = None,
    ) -> None:
        self.pool = pool
        self.prefix = prefix
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.pacer = pacer
        self.num_layers = num_layers
        self.speculator = speculator
        self.alone_step_s = alone_step_s
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # Fair admission: when each session last had a sequence admitted.
        self._last_admitted: dict[str, int] = {}
        self._admissions = 0
        # Admission keeps a little headroom so a new prompt does not force a preemption.
        self._watermark = max(1, pool.num_blocks // 100)
        # Finished sequences whose blocks are not released yet (see finish).
        self._retiring: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._retiring)

    def schedule(self) -> list[ScheduledSeq]:
        if self.waiting:
            self.release_finished()  # admission counts on their blocks
        batch: list[ScheduledSeq] = []
        for seq in sorted(self._decoding(), key=lambda s: s.arrival):
            if seq.status is Status.RUNNING and self._reserve_or_preempt(seq, batch):
                batch.append(ScheduledSeq(seq, 1))
        num_decodes = len(batch)
        if self.speculator is not None and batch:
            self._add_drafts(batch)
        # Beside decodes, long prompts go a few layers a step (_stage); whole chunks are
        # for short follow-up turns, and for every prompt when nothing decodes, but where
        # a step alone is bounded: there a long prompt goes by layers in steps of about
        # alone_step_s.
        staging = num_decodes > 0 and self.pacer.paces
        alone = num_decodes == 0 and self.alone_step_s is not None
        room = self.max_num_batched_tokens - sum(item.num_new for item in batch)
        budget = min(room, self.pacer.prefill_limit(num_decodes))
        prefilling = self._prefilling()
        shorts_first = False
        if prefilling and num_decodes == 0:
            # Short turns waiting go ahead of the prompts being prefilled, which would
            # otherwise take the whole budget till their last token: an agent's follow-up
            # turn must not queue behind another agent's long cold prompt. Their step
            # leaves the long prompts out, so their first tokens do not wait for a whole
            # chunk of them; from the next step they decode, and the long prompts are paced.
            budget = self._admit(batch, budget, staging, short_only=True)
            shorts_first = bool(batch)  # nothing decodes: these are the turns admitted
        for seq in prefilling:
            if (staging or shorts_first or alone) and not self._short_turn(seq):
                continue
            if seq.staged is not None:  # decodes ended, unbounded: it finishes its layers
                item = self._staged_item(seq, self.num_layers)
            else:
                num_new = min(seq.num_uncomputed, budget)
                if num_new <= 0:
                    continue
                if not self._reserve(seq, num_new):
                    break
                item = ScheduledSeq(seq, num_new)
            batch.append(item)
            budget -= item.num_new
        if not shorts_first:
            self._admit(batch, budget, staging or alone, short_only=False)
        if (staging or alone) and len(batch) == num_decodes:
            self._stage(batch, alone)
        if not batch and len(self.running) > 1:
            # Partly prefilled prompts hold every block and none can grow: make room.
            self.preempt(max(self.running, key=lambda s: s.arrival))
            return self.schedule()
        return batch

    def _admit(
        self,
        batch: list[ScheduledSeq],
        budget: int,
        staging: bool,
        short_only: bool,
    ) -> int:
        """Admit waiting sequences, in _next_waiting's order, with their first chunks in
        `batch` from `budget`; returns the budget left. Passed over: those waiting for
        blocks another sequence is computing, and with `short_only` those that are not
        short turns (_short_turn). `staging`: long prompts go by layers (_stage)."""
        deferred: set[int] = set()
        # A long prompt going by layers is admitted whatever the budget: it takes none.
        while self.waiting and (budget > 0 or staging) and len(self.running) < self.max_num_seqs:
            seq = self._next_waiting(deferred)
            if seq is None:
                break  # the rest wait for their blocks: back from host RAM or disk, or computed
            if seq.restore is not None:
                restored = len(seq.block_table) * self.block_size  # if every block came back
                if short_only and not self._short_turn(seq, restored):
                    deferred.add(id(seq))
                    continue
                self.prefix.finish_restore(seq)
            else:
                found = self.prefix.match(seq)
                cached = found.num_tokens(self.block_size)
                if self._waits_for(found.computing, seq.num_tokens - cached):
                    deferred.add(id(seq))  # admitted once the other one has computed them
                    continue
                if short_only and not self._short_turn(seq, cached):
                    deferred.add(id(seq))
                    continue
                num_new = self._first_chunk(seq, budget, staging, cached)
                if num_new <= 0:
                    break
                # Matched blocks nobody reads now count as free until this sequence takes them.
                takes = -(-(cached + num_new) // self.block_size) - len(found.device_blocks)
                headroom = self._watermark if self.running else 0
                if self.pool.num_free - takes - found.num_unreferenced < headroom:
                    break
                self.prefix.acquire(seq, found)
                if seq.restore is not None:
                    if short_only:  # nothing decodes, so no stream waits on this
                        seq.restore.wait(SHORT_TURN_RESTORE_WAIT_S)
                    continue  # it runs once its blocks are back; others go on meanwhile
            staged = staging and not self._short_turn(seq)
            num_new = self._first_chunk(seq, budget, staging)
            # A long prompt going by layers is admitted without a chunk: _stage picks and
            # reserves the one chunk that goes a few layers this step.
            if num_new <= 0 or not (staged or self._reserve(seq, num_new)):
                # Less was restored, or others took the room: what it holds stays cached.
                self.free(seq)
                seq.num_computed = 0
                break
            self.waiting.remove(seq)
            self._note_admitted(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            if not staged:
                batch.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return budget

    def _waits_for(self, computing: Sequence | None, left: int) -> bool:
        """Whether a sequence with `left` tokens to compute waits for `computing`, which is
        prefilling the block it needs next: where computing its own tokens would take as
        long as the other's next chunk. Agents starting at once share a long system prompt
        that costs more to compute twice; a short prompt sharing a block or two with a long
        one would wait a whole chunk of it (on a CPU, seconds for 2,048 tokens) for what it
        computes in a fraction of that."""
        if computing is None or computing.status is not Status.RUNNING:
            return False
        return left >= min(computing.num_uncomputed, self.max_num_batched_tokens)

    def _first_chunk(
        self, seq: Sequence, budget: int, staging: bool, cached: int | None = None
    ) -> int:
        """Tokens a sequence being admitted computes first: a long prompt going by layers,
        one staged chunk of the pacer's size (_stage sizes and reserves the chunk it runs);
        any other, what the budget leaves. `cached`: as in _short_turn."""
        left = seq.num_uncomputed if cached is None else seq.num_tokens - cached
        if staging and not self._short_turn(seq, cached):
            return self.pacer.staged_chunk_tokens(left)
        return min(left, budget)

    def _stage(self, batch: list[ScheduledSeq], alone: bool = False) -> None:
        """Add one chunk of a long prompt, through the layers the pacer allows beside the
        decodes in `batch`: the chunk under way, else a new one of the long prompt with the
        fewest tokens left (a chunk keeps its size till its last layer). `alone`: nothing
        decodes, and the chunk is what the budget allows, through the layers that fit in
        alone_step_s (the runner's clock stops it there)."""
        prompts = [s for s in self._prefilling() if not self._short_turn(s)]
        if not prompts:
            return
        seq = next((s for s in prompts if s.staged is not None), prompts[0])
        chunk = seq.staged
        if chunk is not None:
            if chunk.alone and not alone:
                # Decodes started while it was under way: on from here in the pacer's size,
                # its other tokens waiting at this layer (alone, till they are sized too).
                keep = self.pacer.staged_chunk_tokens(chunk.num_tokens)
                if keep < chunk.num_tokens:
                    chunk.split(keep)
                chunk.alone = False
            layers = self.num_layers if alone else self.pacer.staged_layers(chunk.num_tokens)
        else:
            room = self.max_num_batched_tokens - sum(item.num_new for item in batch)
            left = min(seq.num_uncomputed, room)
            if alone:
                num_tokens, layers = left, self.num_layers
            else:
                num_tokens = self.pacer.staged_chunk_tokens(left)
                layers = self.pacer.staged_layers(num_tokens) if num_tokens > 0 else 0
            # Without blocks for it the chunk waits: blocks come free as decodes finish.
            if not layers or not self._reserve(seq, num_tokens):
                return
            seq.staged = StagedChunk(num_tokens, alone=alone)
        if layers:
            item = self._staged_item(seq, layers)
            item.slack_s = self.alone_step_s if alone else self.pacer.staged_slack()
            batch.append(item)

    def _staged_item(self, seq: Sequence, num_layers: int) -> ScheduledSeq:
        """The next `num_layers` layers (at most those left) of the sequence's staged chunk."""
        assert seq.staged is not None
        first = seq.staged.next_layer
        last = min(first + num_layers, self.num_layers)
        return ScheduledSeq(
            seq, seq.staged.num_tokens, layers=range(first, last), completes=last == self.num_layers
        )

    def schedule_ahead(
        self, decoding: list[Sequence], continuing: list[Sequence]
    ) -> list[ScheduledSeq]:
        """The step after the running one, planned before that step's tokens are read.
        `decoding`: the running sequences that step decodes; `continuing`: those its tokens
        do not end. Only where it is the step `schedule` would plan: nothing waits, every
        running sequence decodes or is a long prompt going a few layers a step (whose next
        layers join the step, as `_stage` picks them), and every decode has room for one
        more token without preempting anyone; otherwise [] and the next step is scheduled
        as usual. A chunk whose last layer is in flight must have been counted computed
        already: the next chunk starts after it."""
        if self.waiting or not continuing:
            return []
        decodes = {id(seq) for seq in decoding}
        others = [seq for seq in self.running if id(seq) not in decodes]
        if others and (not self.pacer.paces or any(self._short_turn(s) for s in others)):
            return []
        for seq in continuing:  # num_computed lags the step in flight by one
            if not self.pool.grow(seq.block_table, seq.num_computed + 2, self.block_size):
                return []
        batch = [ScheduledSeq(seq, 1) for seq in continuing]
        if others:
            self._stage(batch)
        return batch

    def _next_waiting(self, deferred: set[int]) -> Sequence | None:
        """The sequence to admit next, of those not waiting for a restore or for blocks
        another sequence is computing (`deferred`). One whose blocks came back first: it
        holds them. Then preempted ones: they were running already. Then the session with
        the fewest running sequences, oldest first among equals, so one client's burst of
        requests cannot starve the other agents."""
        ready = [
            s
            for s in self.waiting
            if (s.restore is None or s.restore.done()) and id(s) not in deferred
        ]
        if not ready:
            return None
        running = Counter(_fairness_key(s) for s in self.running)
        turn = self._last_admitted
        return min(
            ready,
            key=lambda s: (
                s.restore is None,
                not s.preempted,
                running[_fairness_key(s)],
                turn.get(_fairness_key(s), -1),  # the session served longest ago first
                s.arrival,
            ),
        )

    def _note_admitted(self, seq: Sequence) -> None:
        self._admissions += 1
        self._last_admitted[_fairness_key(seq)] = self._admissions
        if len(self._last_admitted) > 2 * len(self.waiting) + 64:
            # Only sessions with sequences waiting need their place in the rotation.
            keep = {_fairness_key(s) for s in self.waiting}
            self._last_admitted = {k: v for k, v in self._last_admitted.items() if k in keep}

    def _add_drafts(self, batch: list[ScheduledSeq]) -> None:
        assert self.speculator is not None
        room = self.max_num_batched_tokens - len(batch)
        if self.waiting or self._prefilling():
            room //= 2  # drafts leave waiting prompts at least half of the spare budget
        drafts = self.speculator.plan([item.seq for item in batch])
        for item, draft in zip(batch, drafts, strict=True):
            draft = draft[: max(room, 0)]
            if draft and self._reserve(item.seq, 1 + len(draft)):
                item.draft = draft
                item.num_new += len(draft)
                room -= len(draft)
            elif draft:
                self.speculator.drop(item.seq)

    def trim(self, seq: Sequence) -> None:
        """Give back blocks past the computed tokens (reserved for drafts that missed);
        they hold no committed K/V, so they go straight back to the free list."""
        self.pool.shrink(seq.block_table, seq.num_computed, self.block_size)

    def _decoding(self) -> list[Sequence]:
        return [s for s in self.running if s.num_uncomputed == 1]

    def _prefilling(self) -> list[Sequence]:
        """Prompts being prefilled, fewest tokens left first: an agent's short follow-up
        turn is not queued behind another agent's long cold prompt (which takes what the
        short ones leave of each step's budget)."""
        return sorted((s for s in self.running if s.num_uncomputed > 1), key=_tokens_left)

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        tokens = seq.num_computed + num_new
        if self.pool.grow(seq.block_table, tokens, self.block_size):
            return True
        if not self._retiring:
            return False
        self.release_finished()
        return self.pool.grow(seq.block_table, tokens, self.block_size)

    def _reserve_or_preempt(self, seq: Sequence, batch: list[ScheduledSeq]) -> bool:
        """Find a block for one more token of `seq`, preempting newer sequences if needed."""
        scheduled = {id(item.seq) for item in batch}
        while not self._reserve(seq, 1):
            victims = [s for s in self.running if s is not seq and id(s) not in scheduled]
            if not victims:
                self.preempt(seq)
                return False
            self.preempt(max(victims, key=lambda s: s.arrival))
        return True

    def preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV; it is recomputed from its tokens when it runs again."""
        self.free(seq)
        seq.num_computed = 0
        seq.status = Status.WAITING
        seq.preempted = True
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks; a staged chunk's K/V goes with them."""
        seq.staged = None
        self.prefix.release(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """The sequence stops running now; what it holds is released by the next
        release_finished, which the engine calls once the next step is launched. On a GPU
        that is while the device computes: releasing a long context (8k blocks of a 131k
        prompt, and its session's turn) takes milliseconds of the host, which between two
        steps would stall every other stream. A reservation short of blocks, or a waiting
        prompt, releases them first."""
        seq.finish_reason = reason
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
        seq.staged = None
        self._retiring.append(seq)

    def room_for(self, blocks: int) -> bool:
        """Whether `blocks` blocks can be handed out, releasing finished sequences' first
        where fewer are free."""
        if self.pool.num_free < blocks:
            self.release_finished()
        return self.pool.num_free >= blocks

    def release_finished(self) -> None:
        """Release the blocks of the sequences finished since the last call, and end
        their turns."""
        retiring, self._retiring = self._retiring, []
        for seq in retiring:
            self.free(seq)
            self.prefix.end_turn(seq)
            if self.speculator is not None:
                self.speculator.finish(seq)

    def _short_turn(self, seq: Sequence, cached: int | None = None) -> bool:
        """An agent's follow-up turn: few new prompt tokens, and few left (a prompt
        recomputed after preemption is long again). `cached`: the tokens a prefix match
        found for a sequence not yet admitted."""
        if cached is None:
            new = seq.num_prompt_tokens - (seq.num_cached_tokens or 0)
            left = seq.num_uncomputed
        else:
            new = left = seq.num_tokens - cached
        limit = self.pacer.SHORT_TURN_TOKENS
        return new <= limit and left <= limit


def _tokens_left(seq: Sequence) -> int:
    return seq.num_uncomputed


def _fairness_key(seq: Sequence) -> str:
    """Requests without a session key each count as a session of their own."""
    return seq.session if seq.session is not None else f"request:{seq.request_id}"
