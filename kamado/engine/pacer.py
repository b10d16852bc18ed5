"""Sizes prefill chunks so that running decodes keep their pace beside a long prompt.

A step that carries decodes and a prefill chunk may take at most `factor` times a
decode-only step. The pacer measures both from real steps: the decode-only step time,
and what a chunk adds to it. That extra time is modelled as a fixed part (a chunk makes
every matmul taller and adds its own attention calls, whatever its size) plus a part per
token (which grows with the context the chunk attends to), fitted over recent steps. The
next chunk is sized so the fitted cost plus the fit's typical error stays in the slack;
when the fixed part alone overruns it, the chunk gets the slack on top of the fixed part
(for a follow-up turn, from half the slack on, as long as the fixed part again, at most the
slack).
Where the mixed steps cannot tell the two parts apart (every chunk the same size, as when
one-token chunks already overran the slack), the cost per token of recent prefill-only
steps stands in for the slope.

An agent's follow-up turn (at most SHORT_TURN_TOKENS new prompt tokens) may stretch steps
to `short_factor` instead: its time to first token is what the agent waits on, and a few
longer gaps of the other streams finish it within a few steps. Long prompts keep `factor`.

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
    PRIOR_MIN_TOKENS = 256  # prefill-only steps this large measure the cost per token
    SHORT_TURN_TOKENS = 2048

    def __init__(self, factor: float, max_tokens: int, short_factor: float | None = None) -> None:
        self.factor = factor
        self.short_factor = max(factor, short_factor if short_factor is not None else factor)
        self.max_tokens = max_tokens
        self.decode_step_s: float | None = None
        self.prefill_token_s: float | None = None  # per token, from prefill-only steps
        self._mixed: deque[tuple[int, float]] = deque(maxlen=self.WINDOW)  # (tokens, extra s)
        self._mixed_since_measure = 0

    def prefill_limit(self, num_decodes: int, short_turn: bool = False) -> int:
        """Prefill tokens allowed in the next step beside `num_decodes` decodes (for a short
        follow-up turn, with `short_turn`)."""
        factor = self.short_factor if short_turn else self.factor
        if num_decodes == 0 or math.isinf(factor):
            return self.max_tokens
        if self.decode_step_s is None or self._mixed_since_measure >= self.REMEASURE_EVERY:
            return 0  # take one decode-only step to learn what a normal gap is
        if not self._mixed:
            return self.MIN_CHUNK
        fixed, per_token, error = self.cost_model()
        slack = (factor - 1.0) * self.decode_step_s
        # Where a chunk's fixed part alone overruns the slack (a mixed step runs eagerly
        # beside decodes replayed from CUDA graphs), a one-token chunk stalls the streams
        # about as long as a chunk worth the slack: take the slack's worth, so prefill still
        # moves. A follow-up turn does so already where the fixed part takes half the slack:
        # its first token is what an agent waits on (with the fixed part just under the
        # slack, follow-ups crawled at a token a step). A long prompt keeps to the factor
        # where it can: with this rule for every prompt, the 16k CPU fairness run's median
        # gap was 1.51x (1.30x before).
        overhead = fixed + error
        overrun = overhead >= (slack / 2 if short_turn else slack)
        usable = max(slack - overhead, min(overhead, slack)) if overrun else slack - overhead
        fits = int(usable / per_token)
        largest = max(tokens for tokens, _ in self._mixed)
        return max(self.MIN_CHUNK, min(self.max_tokens, fits, self.MAX_GROWTH * largest))

    def cost_model(self) -> tuple[float, float, float]:
        """(fixed s, s per token, typical error s) of the time a chunk adds to a step."""
        # A one-token chunk beside decodes is one more decode row (on a GPU, replayed in the
        # decode graph: 21.5 ms beside two decodes at 100k, against 28.9 ms for two tokens),
        # so it is off the line of longer chunks: fitted only while nothing longer was seen.
        points = [(t, e) for t, e in self._mixed if t > 1] or list(self._mixed)
        mean_t = statistics.fmean(t for t, _ in points)
        mean_e = statistics.fmean(e for _, e in points)
        spread = sum((t - mean_t) ** 2 for t, _ in points)
        fixed, per_token = 0.0, mean_e / mean_t  # the average, unless a slope shows
        slope = sum((t - mean_t) * (e - mean_e) for t, e in points) / spread if spread else 0.0
        intercept = mean_e - slope * mean_t
        if slope > 0 and intercept >= 0 and _stands_out(points, slope, intercept, spread):
            fixed, per_token = intercept, slope
        elif self.prefill_token_s is not None and self.prefill_token_s < per_token:
            # The sizes seen cannot separate the parts: take the slope prefill alone shows.
            fixed, per_token = mean_e - self.prefill_token_s * mean_t, self.prefill_token_s
        per_token = max(per_token, 1e-6)
        residuals = [e - fixed - per_token * t for t, e in points]
        error = statistics.pstdev(residuals) if len(residuals) > 1 else 0.0
        return fixed, per_token, error

    def observe(self, num_decodes: int, num_prefill_tokens: int, seconds: float) -> None:
        if not num_decodes:
            # Says nothing about a decode's pace, but what prefill costs a token.
            if num_prefill_tokens >= self.PRIOR_MIN_TOKENS:
                self.prefill_token_s = self._ema(self.prefill_token_s, seconds / num_prefill_tokens)
            return
        if not num_prefill_tokens:
            self.decode_step_s = self._ema(self.decode_step_s, seconds)
            self._mixed_since_measure = 0
        elif self.decode_step_s is not None:
            self._mixed.append((num_prefill_tokens, max(seconds - self.decode_step_s, 0.0)))
            self._mixed_since_measure += 1

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.EMA) * old + self.EMA * new


def _stands_out(
    points: list[tuple[int, float]], slope: float, intercept: float, spread: float
) -> bool:
    """Whether a fitted slope is more than twice its standard error. Chunks of nearly one
    size fit a slope that is mostly step-time noise, and a slope too steep holds chunks at
    one token for as long as it stays in the window."""
    if len(points) < 3:
        return False
    squares = sum((e - intercept - slope * t) ** 2 for t, e in points)
    return slope > 2 * math.sqrt(squares / (len(points) - 2) / spread)
