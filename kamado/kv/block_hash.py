"""Content keys of full KV blocks: a block's tokens chained to everything before them.

Two blocks share a key only when the whole token prefix up to their end is the same, so a
key names the K/V a block holds. Keys are stable across processes (the disk tier relies
on that), unlike Python's hash().
"""

from __future__ import annotations

import hashlib
from array import array

ROOT = b""


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def extend_keys(keys: list[bytes], token_ids: list[int], num_full: int, block_size: int) -> None:
    """Append the keys of blocks len(keys)..num_full-1 of `token_ids` (keys are append-only,
    like the tokens they hash)."""
    for b in range(len(keys), num_full):
        parent = keys[-1] if keys else ROOT
        keys.append(block_key(parent, token_ids[b * block_size : (b + 1) * block_size]))
