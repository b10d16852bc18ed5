"""Single tokens as OpenAI shows them in logprobs: the token's text and its raw bytes."""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE: the printable stand-in character of each byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self._cache: dict[int, tuple[str, list[int]]] = {}
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = decoder is None or "ByteLevel" in repr(decoder)

    def _compute(self, token_id: int) -> tuple[str, list[int]]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return "", []
        if token_id in self._special:
            return piece, list(piece.encode("utf-8"))
        if m := _BYTE_FALLBACK.match(piece):
            raw = bytes([int(m.group(1), 16)])
        else:
            table = byte_decoder()
            if self._byte_level and all(ch in table for ch in piece):
                raw = bytes(table[ch] for ch in piece)
            else:  # SentencePiece: "▁" marks a space
                raw = piece.replace("\u2581", " ").encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)

    def get(self, token_id: int) -> tuple[str, list[int]]:
        """(text, bytes) of one token; text has U+FFFD where the token splits a character."""
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._compute(token_id)
        return hit
