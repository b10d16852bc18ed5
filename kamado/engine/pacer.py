"""Sizes prefill chunks so that running decodes keep their pace beside a long prompt.

A step that carries decodes and a prefill chunk may take at most `factor` times a
decode-only step. The pacer measures both from real steps: the decode-only step time,
and what a chunk adds to it. That extra time is modelled as a fixed part (a chunk makes
every matmul taller and adds its own attention calls, whatever its size) plus a part per
token (which grows with the context the chunk attends to), fitted over recent steps. The
next chunk is sized so the fitted cost plus the fit's typical error stays in the slack;
when the fixed part alone overruns it, the chunk gets the slack on top of the fixed part.

With speculation, a decode's draft tokens belong to the decode side: a step of decodes
and verifications is a decode-only step (the normal gap of a stream that speculates), and
only prompt tokens count as prefill, so verification never passes for prefill work.
"""

from __future__ import annotations

import math
import statistics
from collections import deque


class PrefillPacer:
    REMEASURE_EVERY = 64  # mixed steps between fresh decode-only measurements
    WINDOW = 32  # recent mixed steps the cost model is fitted on
    MIN_CHUNK = 1  # progress is guaranteed even when one token already costs too much
    MAX_GROWTH = 2  # a chunk is at most twice the largest one measured: no wild extrapolation
    EMA = 0.3

    def __init__(self, factor: float, max_tokens: int) -> None:
        self.factor = factor
        self.max_tokens = max_tokens
        self.decode_step_s: float | None = None
        self._mixed: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)  # (tokens, extra s)
        self._mixed_since_measure = 0

    def prefill_limit(self, num_decodes: int) -> int:
        """Prefill tokens allowed in the next step beside `num_decodes` decodes."""
        if num_decodes == 0 or math.isinf(self.factor):
            return self.max_tokens
        if self.decode_step_s is None or self._mixed_since_measure >= self.REMEASURE_EVERY:
            return 0  # take one decode-only step to learn what a normal gap is
        if not self._mixed:
            return self.MIN_CHUNK
        fixed, per_token, error = self.cost_model()
        slack = (self.factor - 1.0) * self.decode_step_s
        # Where any chunk at all costs more than the slack (a mixed step runs eagerly beside
        # decodes replayed from CUDA graphs), a one-token chunk stalls the streams about as
        # long as a chunk worth the slack: take the slack's worth, so prefill still moves.
        usable = slack - fixed - error if fixed + error < slack else slack
        fits = int(usable / per_token)
        largest = max(tokens for tokens, _ in self._mixed)
        return max(self.MIN_CHUNK, min(self.max_tokens, fits, self.MAX_GROWTH * largest))

    def cost_model(self) -> tuple[float, float, float]:
        """(fixed s, s per token, typical error s) of the time a chunk adds to a step."""
        tokens = [t for t, _ in self._mixed]
        extra = [e for _, e in self._mixed]
        mean_t, mean_e = statistics.fmean(tokens), statistics.fmean(extra)
        spread = sum((t - mean_t) ** 2 for t in tokens)
        fixed, per_token = 0.0, mean_e / mean_t
        if spread > 0:
            slope = sum((t - mean_t) * (e - mean_e) for t, e in self._mixed) / spread
            intercept = mean_e - slope * mean_t
            if slope > 0 and intercept >= 0:  # else noise hides the shape: use the average
                fixed, per_token = intercept, slope
        per_token = max(per_token, 1e-6)
        residuals = [e - fixed - per_token * t for t, e in self._mixed]
        error = statistics.pstdev(residuals) if len(residuals) > 1 else 0.0
        return fixed, per_token, error

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if not num_decodes:
            return  # a step without decodes says nothing about a decode's pace
        if not num_prefill_tokens:
            self.decode_step_s = self._ema(self.decode_step_s, seconds)
            self._mixed_since_measure = 0
        elif self.decode_step_s is not None:
            self._mixed.append((num_prefill_tokens, max(seconds - self.decode_step_s, 0.0)))
            self._mixed_since_measure += 1

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.EMA) * old + self.EMA * new
