"""The interface every draft proposer implements."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence


class Proposer(Protocol):
    """Guesses the tokens a sequence will produce next; the target model verifies them."""

    name: str

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to `k` tokens likely to follow `seq.token_ids` (fewer, or none, when unsure)."""
        ...

    def finish(self, seq: Sequence) -> None:
        """The sequence is done: drop what was kept for it (and learn from its output)."""
        ...


def copy_forward(tokens: list[int], start: int, k: int) -> list[int]:
    """Up to `k` tokens read from `start` on, where reading past the end continues into
    what was just read: a match one period back drafts the repeating pattern onward."""
    draft = tokens[start : start + k]
    while draft and len(draft) < k:  # start + len(draft) is past the end: read the draft
        draft.append(draft[start + len(draft) - len(tokens)])
    return draft
