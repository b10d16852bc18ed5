"""Prompt lookup: the tokens that followed the last earlier occurrence of the request's
newest n-gram are proposed as its continuation.

Agents paste files and then quote or rewrite them, so the most recent occurrence of the
last few tokens is usually where the output is copying from. Each sequence keeps an index
from n-gram to the position right after its latest occurrence, extended incrementally as
tokens arrive, so a step costs O(new tokens) even over a 100k-token context.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kamado.spec.proposer import copy_forward

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

_BITS = 20  # token ids below 2**20 pack into one int key per n-gram
INDEX_PER_CALL = 4096  # positions indexed per call at most


class _Index:
    def __init__(self, sizes: tuple[int, ...]) -> None:
        self.after: dict[int, dict[int, int]] = {n: {} for n in sizes}
        self.indexed = 0  # n-grams ending before this position are in the index


def _key(tokens: list[int], end: int, n: int) -> int:
    key = 0
    for t in tokens[end - n : end]:
        key = (key << _BITS) | t
    return key


class NgramProposer:
    name = "ngram"

    def __init__(self, sizes: tuple[int, ...] = (4, 3, 2)) -> None:
        self.sizes = tuple(sorted(sizes, reverse=True))  # longest match first
        self._indexes: dict[Sequence, _Index] = {}

    def propose(self, seq: Sequence, k: int) -> list[int]:
        tokens = seq.token_ids
        index = self._indexes.setdefault(seq, _Index(self.sizes))
        # Index every n-gram except the one ending at the last token: that is the query,
        # and its own occurrence must not answer it.
        # A long new prompt is indexed over several steps (a bounded cost per step); what
        # is indexed already still answers.
        stop = min(len(tokens), max(index.indexed, 1) + INDEX_PER_CALL)
        for end in range(max(index.indexed, 1), stop):
            for n, after in index.after.items():
                if end >= n:
                    after[_key(tokens, end, n)] = end
        index.indexed = max(index.indexed, stop)
        for n, after in index.after.items():
            if len(tokens) > n and (start := after.get(_key(tokens, len(tokens), n))) is not None:
                return copy_forward(tokens, start, k)
        return []

    def finish(self, seq: Sequence) -> None:
        self._indexes.pop(seq, None)
