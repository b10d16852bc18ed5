"""Cached blocks found by the tokens they begin with, for reuse inside a block.

A content key names a full block, so a lookup by key reuses whole blocks only. Here every
cached block is also filed under the key of the block before it with its computed tokens:
full blocks, and the partly filled last block a sequence left behind. A later sequence whose
full-block chain ends at that parent copies the block whose tokens share the longest start
with its own next tokens, and skips those: an agent's next turn continues the tail its
previous turn computed, and a retried prompt finds its own last, partly filled block.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from hashlib import blake2b


def partial_block_key(parent: bytes, tokens: list[int]) -> bytes:
    """The pool key of a partly filled block: apart from full-block keys by construction."""
    data = parent + array("q", tokens).tobytes()
    return blake2b(data, digest_size=16, person=b"kamado-partial").digest()


@dataclass
class TokenMatch:
    block: int
    num_tokens: int  # leading tokens of `block` equal to the sequence's next tokens


class BlockTokens:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (parent key, first token) -> block -> its tokens: a lookup scans only blocks that
        # share at least one token, however many sequences branched off after the parent.
        self._children: dict[tuple[bytes, int], dict[int, tuple[int, ...]]] = {}
        self._parent_of: dict[int, tuple[bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._parent_of)

    def add(self, block: int, parent: bytes, tokens: list[int]) -> None:
        """`block` holds the computed K/V of `tokens`, which follow the block keyed `parent`."""
        branch = (parent, tokens[0])
        self._children.setdefault(branch, {})[block] = tuple(tokens)
        self._parent_of[block] = branch

    def forget(self, block: int) -> bool:
        """The block's slot is reused; True when it was a partly filled block."""
        branch = self._parent_of.pop(block, None)
        if branch is None:
            return False  # a full block restored from disk is not filed here
        children = self._children[branch]
        tokens = children.pop(block)
        if not children:
            del self._children[branch]
        return len(tokens) < self.block_size

    def longest(self, parent: bytes, tokens: list[int]) -> TokenMatch | None:
        """The block after `parent` whose tokens start with the most of `tokens` (not empty)."""
        best: TokenMatch | None = None
        for block, held in self._children.get((parent, tokens[0]), {}).items():
            n = 0
            for mine, theirs in zip(tokens, held, strict=False):
                if mine != theirs:
                    break
                n += 1
            if n and (best is None or n > best.num_tokens):
                best = TokenMatch(block, n)
        return best
