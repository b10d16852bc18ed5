"""Sizes prefill chunks so that running decodes keep their pace beside a long prompt.

A step that carries decodes and a prefill chunk may take at most `factor` times a
decode-only step. The pacer measures both from real steps: the decode-only step time,
and the marginal cost of each prefill token beside it (which grows with context).
"""

from __future__ import annotations

import math


class PrefillPacer:
    REMEASURE_EVERY = 64  # mixed steps between fresh decode-only measurements
    MIN_CHUNK = 1  # progress is guaranteed even when one token already costs too much
    EMA = 0.3

    def __init__(self, factor: float, max_tokens: int) -> None:
        self.factor = factor
        self.max_tokens = max_tokens
        self.decode_step_s: float | None = None
        self.per_token_s: float | None = None
        self._mixed_since_measure = 0

    def prefill_limit(self, num_decodes: int) -> int:
        """Prefill tokens allowed in the next step beside `num_decodes` decodes."""
        if num_decodes == 0 or math.isinf(self.factor):
            return self.max_tokens
        if self.decode_step_s is None or self._mixed_since_measure >= self.REMEASURE_EVERY:
            return 0  # take one decode-only step to learn what a normal gap is
        if self.per_token_s is None:
            return self.MIN_CHUNK
        slack = (self.factor - 1.0) * self.decode_step_s
        return max(self.MIN_CHUNK, min(self.max_tokens, int(slack / self.per_token_s)))

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if num_decodes and not num_prefill_tokens:
            self.decode_step_s = self._ema(self.decode_step_s, seconds)
            self._mixed_since_measure = 0
        elif num_decodes and num_prefill_tokens and self.decode_step_s is not None:
            marginal = max(seconds - self.decode_step_s, 0.0) / num_prefill_tokens
            self.per_token_s = self._ema(self.per_token_s, marginal)
            self._mixed_since_measure += 1
        elif num_prefill_tokens and self.per_token_s is None:
            self.per_token_s = seconds / num_prefill_tokens  # a first, pessimistic guess

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.EMA) * old + self.EMA * new
