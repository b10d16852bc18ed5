"""Plans each step's drafts: asks every proposer, keeps each sequence's most promising
draft, lets the controller size them for the batch, and keeps the acceptance counters.

Requests under a grammar constraint are not speculated on: the draft would have to be
checked against the grammar token by token and the matcher rolled back on a miss; they
decode one token per step, as without speculation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.config import EngineConfig
from kamado.spec.controller import Candidate, Controller, SeqRates
from kamado.spec.proposer import Proposer

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence


PROBE_EVERY = 4  # steps between one-token probes of a sequence not worth drafting for


@dataclass
class SpecStats:
    """Per proposer: tokens drafted, drafted tokens accepted, drafts verified."""

    drafted: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    verified: dict[str, int] = field(default_factory=dict)

    def add(self, proposer: str, num_drafted: int, num_accepted: int) -> None:
        self.drafted[proposer] = self.drafted.get(proposer, 0) + num_drafted
        self.accepted[proposer] = self.accepted.get(proposer, 0) + num_accepted
        self.verified[proposer] = self.verified.get(proposer, 0) + 1


@dataclass
class _SeqSpec:
    rates: SeqRates = field(default_factory=SeqRates)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # this step's, by proposer
    proposer: str | None = None  # whose draft is being verified this step
    idle: int = 0  # steps since the controller last wanted drafts for it
    late: int = 0  # a step planned blind: the draft length to propose once its input is in


@dataclass
class _Ask:
    """What a step asks the proposers for, for one sequence."""

    limit: int  # the longest draft worth asking for (0: none); 1 for a probe
    idle: int  # the sequence's idle count after the step
    rates: dict[str, float]  # each proposer's acceptance rate

    @property
    def rate(self) -> float:
        return max(self.rates.values())


class Speculator:
    def __init__(
        self, proposers: list[Proposer], max_draft: int, max_model_len: int, device: str = "cpu"
    ) -> None:
        self.proposers = proposers
        self.controller = Controller(max_draft, device)
        self.max_model_len = max_model_len
        self.stats = SpecStats()
        self._seqs: dict[Sequence, _SeqSpec] = {}

    def plan(self, seqs: list[Sequence]) -> list[list[int]]:
        """Draft tokens to verify after each decoding sequence's last token this step."""
        best = [self._best_draft(seq, len(seqs)) for seq in seqs]
        lengths = self.controller.draft_lengths(len(seqs), best)
        drafts = []
        for seq, candidate, n in zip(seqs, best, lengths, strict=True):
            self._seqs[seq].proposer = candidate.proposer if candidate and n else None
            drafts.append(candidate.draft[:n] if candidate and n else [])
        return drafts

    def plan_none(self, seqs: list[Sequence]) -> bool:
        """Plan a step of `seqs` before their newest tokens are in, where the plan is no
        drafts whatever those tokens are: the controller would verify none even at each
        one's best acceptance rate and longest useful draft. True, and the step counts as
        planned; the proposers are asked once the tokens are in (`propose_late`), so their
        drafts are scored against the step's output as if it had been planned from them.
        The rates it plans with may lack the step still in flight: the controller follows
        acceptance a step later, and never changes what is emitted."""
        states = {seq: self._seqs.setdefault(seq, _SeqSpec()) for seq in seqs}
        asks = {seq: self._ask(seq, state, len(seqs)) for seq, state in states.items()}
        best = [Candidate([0] * a.limit, a.rate, "") if a.limit else None for a in asks.values()]
        if any(self.controller.draft_lengths(len(seqs), best)):
            return False
        for seq, state in states.items():
            # The drafts of the step before, still in flight, are scored when it is read.
            state.proposer, state.idle, state.late = None, asks[seq].idle, asks[seq].limit
        return True

    def propose_late(self, seq: Sequence) -> None:
        """The input token of a step planned blind is in: ask the proposers now, to score
        their drafts against what that step emits."""
        state = self._seqs.get(seq)
        if state is None or not state.late:
            return
        limit, state.late = min(state.late, self._room(seq)), 0
        for proposer in self.proposers if limit > 0 else ():
            if draft := proposer.propose(seq, limit):
                state.drafts[proposer.name] = draft

    def _ask(self, seq: Sequence, state: _SeqSpec, batch_size: int) -> _Ask:
        rates = {p.name: self.controller.rate(state.rates, p.name) for p in self.proposers}
        # No proposer is asked for more than the best of them could be verified for; when
        # that is nothing, a one-token draft now and then keeps measuring them.
        limit = self.controller.useful_length(max(rates.values()), batch_size)
        idle = 0 if limit else state.idle + 1
        if not limit and idle % PROBE_EVERY == 0:
            limit = 1
        return _Ask(max(min(limit, self._room(seq)), 0), idle, rates)

    def _best_draft(self, seq: Sequence, batch_size: int) -> Candidate | None:
        state = self._seqs.setdefault(seq, _SeqSpec())
        state.drafts = {}
        ask = self._ask(seq, state, batch_size)
        state.idle = ask.idle
        if ask.limit <= 0:
            return None
        limit, rates = ask.limit, ask.rates
        best, best_gain = None, 0.0
        for proposer in self.proposers:
            draft = proposer.propose(seq, limit)
            if not draft:
                continue
            state.drafts[proposer.name] = draft
            rate = rates[proposer.name]
            gain = sum(rate**j for j in range(1, len(draft) + 1))
            if gain > best_gain:
                best, best_gain = Candidate(draft, rate, proposer.name), gain
        return best

    def _room(self, seq: Sequence) -> int:
        """Drafts beyond this could never be emitted: the step's own token comes first."""
        p = seq.params
        if p.constraint is not None:
            return 0
        room = self.max_model_len - seq.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - seq.num_output_tokens - 1)
        return room

    def drop(self, seq: Sequence) -> None:
        """The planned draft was not scheduled (no free block for it)."""
        if (state := self._seqs.get(seq)) is not None:
            state.proposer = None

    def observe(self, seq: Sequence, emitted: list[int], num_drafted: int) -> None:
        """What a step emitted for a sequence (before stop conditions cut it): every
        proposer's draft is scored against it; the verified one's counts go to the stats."""
        state = self._seqs.get(seq)
        if state is None:
            return
        for name, draft in state.drafts.items():
            self.controller.observe(state.rates, name, draft, emitted)
        if state.proposer is not None and num_drafted:
            self.stats.add(state.proposer, num_drafted, len(emitted) - 1)
        state.drafts = {}

    def observe_step(self, num_tokens: int, num_drafted: int, seconds: float) -> None:
        """A step of decodes and verifications only: what its tokens cost."""
        self.controller.cost.observe(num_tokens, num_drafted, seconds)

    def finish(self, seq: Sequence) -> None:
        self._seqs.pop(seq, None)
        for proposer in self.proposers:
            proposer.finish(seq)


def make_speculator(config: EngineConfig, max_model_len: int, vocab_size: int) -> Speculator | None:
    """The speculator for `config.speculation`, or None when it is off."""
    from kamado.spec.ngram import NgramProposer
    from kamado.spec.suffix import SuffixProposer

    mode = config.speculation
    proposers: list[Proposer]
    if mode.startswith("draft:"):
        from kamado.spec.draft_model import DraftModelProposer

        proposers = [DraftModelProposer(config, mode.removeprefix("draft:"), vocab_size)]
    else:
        choices: dict[str, list[Proposer]] = {
            "off": [],
            "auto": [NgramProposer(), SuffixProposer()],
            "ngram": [NgramProposer()],
            "suffix": [SuffixProposer()],
        }
        if mode not in choices:
            raise ValueError(
                f"speculation must be one of {', '.join(choices)} or draft:MODEL; got {mode!r}"
            )
        proposers = choices[mode]
    if not proposers or config.spec_max_draft <= 0:
        return None
    return Speculator(proposers, config.spec_max_draft, max_model_len, config.device)
