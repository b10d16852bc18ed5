"""Suffix drafts (after SuffixDecoding, arXiv 2411.04975): the longest suffix of the
request's tokens found in (1) the request itself, (2) its session's earlier outputs, or
(3) recent outputs of every request; the tokens that followed it there are the draft.

A longer match is stronger evidence that the continuation repeats too, so a match of
length m drafts at most ALPHA * m tokens (SuffixDecoding's adaptive speculation length).
Each source is a suffix automaton (`suffix_automaton.py`); the request's own one is built
lazily when it first decodes and extended as tokens arrive. The stores of finished outputs
are bounded: when one overflows it keeps its newest outputs and is rebuilt.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.spec.proposer import copy_forward
from kamado.spec.suffix_automaton import Matcher, SuffixAutomaton

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

ALPHA = 2.0  # draft tokens allowed per matched token
MIN_MATCH = 2  # a single repeated token says little about what follows it
EXTEND_PER_CALL = 4096  # tokens added to a request's own automaton per call at most
MATCHER_WARMUP = 64  # tokens a fresh matcher reads to find the current match
GLOBAL_TOKENS = 1 << 16  # recent outputs of all requests
SESSION_TOKENS = 1 << 14  # earlier outputs of one session
MAX_SESSIONS = 64


class OutputStore:
    """Finished outputs, newest last, in one automaton (separated so no match spans two)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.outputs: deque[list[int]] = deque()
        self.automaton = SuffixAutomaton()
        self.generation = 0  # bumped on rebuild: matchers of the old automaton are void
        self._separators = 0

    def add(self, output: list[int]) -> None:
        output = output[-self.capacity :]
        self.outputs.append(output)
        if len(self.automaton.tokens) + len(output) + 1 > self.capacity:
            while sum(len(o) + 1 for o in self.outputs) > self.capacity:
                self.outputs.popleft()
            self.automaton = SuffixAutomaton()
            self.generation += 1
            for kept in self.outputs:
                self._append(kept)
        else:
            self._append(output)

    def _append(self, output: list[int]) -> None:
        for token in output:
            self.automaton.extend(token)
        self._separators += 1
        self.automaton.extend(-self._separators)  # unique: matches stop at an output's end

    def continuation(self, end: int, k: int) -> list[int]:
        draft = []
        for token in self.automaton.tokens[end + 1 : end + 1 + k]:
            if token < 0:
                break
            draft.append(token)
        return draft


@dataclass
class _StoreWalk:
    """Where a sequence's newest tokens match in one store."""

    store: OutputStore
    generation: int
    matcher: Matcher
    fed: int  # tokens of the sequence fed to the matcher


@dataclass
class _SeqState:
    own: SuffixAutomaton = field(default_factory=SuffixAutomaton)
    walks: dict[int, _StoreWalk] = field(default_factory=dict)  # by id of the store


class SuffixProposer:
    name = "suffix"

    def __init__(self) -> None:
        self.global_store = OutputStore(GLOBAL_TOKENS)
        self.sessions: OrderedDict[str, OutputStore] = OrderedDict()
        self._states: dict[Sequence, _SeqState] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        state = self._states.setdefault(seq, _SeqState())
        tokens = seq.token_ids
        # A long new prompt enters the automaton over several steps (a bounded cost per
        # step); until it is in, the request's own tokens are not searched.
        built = len(state.own.tokens)
        for token in tokens[built : built + EXTEND_PER_CALL]:
            state.own.extend(token)
        best_len, best = 0, []
        length, end = state.own.longest_repeat()
        if len(state.own.tokens) == len(tokens) and length >= MIN_MATCH:
            best_len, best = length, copy_forward(tokens, end + 1, k)
        for store in self._stores_for(seq):
            length, end = self._walk(state, store, tokens).match()
            if length > best_len and length >= MIN_MATCH:
                best_len, best = length, store.continuation(end, k)
        return best[: int(ALPHA * best_len)]

    def _stores_for(self, seq: Sequence) -> list[OutputStore]:
        stores = [self.global_store]
        if seq.session is not None and (session := self.sessions.get(seq.session)):
            stores.append(session)
        return stores

    def _walk(self, state: _SeqState, store: OutputStore, tokens: list[int]) -> Matcher:
        walk = state.walks.get(id(store))
        if walk is None or walk.store is not store or walk.generation != store.generation:
            start = max(0, len(tokens) - MATCHER_WARMUP)
            walk = _StoreWalk(store, store.generation, Matcher(store.automaton), start)
            state.walks[id(store)] = walk
        for token in tokens[walk.fed :]:
            walk.matcher.feed(token)
        walk.fed = len(tokens)
        return walk.matcher

    def finish(self, seq: Sequence) -> None:
        self._states.pop(seq, None)
        output = seq.token_ids[seq.num_prompt_tokens :]
        if not output:
            return
        self.global_store.add(output)
        if seq.session is not None:
            session = self.sessions.pop(seq.session, None) or OutputStore(SESSION_TOKENS)
            session.add(output)
            self.sessions[seq.session] = session  # newest last
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
