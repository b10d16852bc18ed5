"""Paces prompts beside running decodes, so the decodes keep their pace.

A step that carries decodes and prompt work may take at most `factor` times a
decode-only step (the normal gap, the median of recent decode-only steps). The pacer
measures what prompt work adds to a step and sizes the next piece of it to the slack.

A long prompt goes a few layers per step (`staged_chunk_tokens`, `staged_layers`): a
chunk's tokens run through some of the layers in one step and through the next ones in
the steps after. One layer of a chunk costs a fixed part (reading that layer's weights,
its kernel launches, reading its K/V of the context) plus a part per token; the two are
fitted over recent steps. A new chunk is sized so STAGED_TARGET_LAYERS of its layers fit
the slack, and each step runs as many of its layers as fit. Splitting by layers is what
keeps a step short deep into a long prompt, where even one token through every layer
reads the whole context's K/V and would take longer than the slack.

An agent's follow-up turn (at most SHORT_TURN_TOKENS new prompt tokens) runs through
every layer in one step (`prefill_limit`) and may stretch steps to `short_factor`: its
time to first token is what the agent waits on, and a few longer gaps of the other
streams finish it within a few steps. Its chunk's extra time is modelled the same way,
a fixed part plus a part per token, over whole chunks. When the fixed part takes half
the slack or more, the chunk gets as long again on top, at most the slack.
Where the steps cannot tell the two parts apart (every chunk the same size, as when
one-token chunks already overran the slack), the cost per token of recent prefill-only
steps stands in for the slope.

With speculation, a decode's draft tokens belong to the decode side: a step of decodes
and verifications is a decode-only step (the normal gap of a stream that speculates), and
only prompt tokens count as prompt work, so verification never passes for it.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

Point = tuple[int, float]  # (chunk tokens, seconds the chunk added to the step)


def chunk_sizes(up_to: int) -> list[int]:
    """The sizes a staged chunk takes, up to `up_to`: 1, 2, 3, 4, 6, 8, 12, 16, 24, ...
    (two a doubling). Few sizes, so each runs its matmuls many times: on the H200 the first
    step with a new matmul shape took 10-20 ms where the same step takes under 1 ms."""
    sizes: list[int] = []
    power = 1
    while power <= up_to:
        for n in (power, power + power // 2):
            if n <= up_to and n not in sizes:
                sizes.append(n)
        power *= 2
    return sizes


class PrefillPacer:
    REMEASURE_EVERY = 64  # steps with prompt work between fresh decode-only measurements,
    REMEASURE_SECONDS = 4.0  # or their seconds: a CPU's pace drifts by 10-15% in a minute
    DECODE_WINDOW = 5  # decode-only steps whose median is the normal gap
    WINDOW = 32  # recent steps with prompt work the cost models are fitted on
    MIN_CHUNK = 1  # progress is guaranteed even when one token already costs too much
    MAX_GROWTH = 2  # a chunk is at most twice the largest one measured: no wild extrapolation
    FIRST_STAGED_CHUNK = 16  # tokens of a staged chunk before any was measured
    STAGED_TARGET_LAYERS = 2  # a new staged chunk is sized for this many layers a step
    EMA = 0.3
    PRIOR_MIN_TOKENS = 256  # prefill-only steps this large measure the cost per token
    SHORT_TURN_TOKENS = 2048

    def __init__(
        self,
        factor: float,
        max_tokens: int,
        short_factor: float | None = None,
        num_layers: int | None = None,
    ) -> None:
        self.factor = factor
        self.short_factor = max(factor, short_factor if short_factor is not None else factor)
        self.max_tokens = max_tokens
        # The model's layers: a chunk going by layers with nothing decoding then measures
        # what prefill costs a token too (None: only chunks through every layer do).
        self.num_layers = num_layers
        self.prefill_token_s: float | None = None  # per token, from prefill-only steps
        self._decode_steps: deque[float] = deque(maxlen=self.DECODE_WINDOW)
        self._mixed: deque[Point] = deque(maxlen=self.WINDOW)  # whole chunks
        self._staged: deque[Point] = deque(maxlen=self.WINDOW)  # per layer of staged chunks
        self._most_layers: dict[int, int] = {}  # chunk size -> most layers run in one step
        self._since_measure = 0
        self._since_measure_s = 0.0

    @property
    def paces(self) -> bool:
        """Whether prompts beside decodes are paced at all (a finite factor)."""
        return not math.isinf(self.factor)

    @property
    def decode_step_s(self) -> float | None:
        """The normal gap: the median of recent decode-only steps. A median, because one
        slow step (a new prompt admitted, a collection) must not widen every slack after."""
        return statistics.median(self._decode_steps) if self._decode_steps else None

    def _measure_first(self) -> bool:
        """Whether the next step should be decode-only, to learn (again) the normal gap."""
        return (
            not self._decode_steps
            or self._since_measure >= self.REMEASURE_EVERY
            or self._since_measure_s >= self.REMEASURE_SECONDS
        )

    def _slack(self, factor: float) -> float:
        assert self.decode_step_s is not None
        return (factor - 1.0) * self.decode_step_s

    # ---- follow-up turns: whole chunks ------------------------------------------------

    def prefill_limit(self, num_decodes: int) -> int:
        """Tokens of a follow-up turn allowed through every layer in the next step beside
        `num_decodes` decodes (any prompt's, without decodes)."""
        if num_decodes == 0 or math.isinf(self.short_factor):
            return self.max_tokens
        if self._measure_first():
            return 0
        if not self._mixed:
            return self.MIN_CHUNK
        fixed, per_token, error = self.cost_model()
        slack = self._slack(self.short_factor)
        # Where a chunk's fixed part takes half the slack or more (a mixed step runs
        # eagerly beside decodes replayed from CUDA graphs), a one-token chunk stalls the
        # streams nearly as long as a chunk worth the slack: the tokens get as long again
        # as the fixed part, at most the slack, so the turn does not crawl a token a step.
        overhead = fixed + error
        usable = slack - overhead
        if overhead >= slack / 2:
            usable = max(usable, min(overhead, slack))
        largest = max(tokens for tokens, _ in self._mixed)
        return self._clamp(int(usable / per_token), largest)

    def cost_model(self) -> tuple[float, float, float]:
        """(fixed s, s per token, typical error s) of the time a whole chunk adds to a step."""
        # A one-token chunk beside decodes is one more decode row (on a GPU, replayed in the
        # decode graph: 21.5 ms beside two decodes at 100k, against 28.9 ms for two tokens),
        # so it is off the line of longer chunks: fitted only while nothing longer was seen.
        points = [(t, e) for t, e in self._mixed if t > 1] or list(self._mixed)
        return _fit(points, self.prefill_token_s)

    # ---- long prompts: chunks a few layers a step -------------------------------------

    def staged_chunk_tokens(self, left: int) -> int:
        """Tokens of a new chunk of a long prompt, to go a few layers per step, with `left`
        tokens to go (or room for). Always one of the chunk sizes, the end of a prompt
        too: the first step with a matmul shape never run is slow (a 52-token last chunk
        of a 131k prompt took 18 ms through 2 layers beside 8 ms steps on the H200)."""
        sizes = chunk_sizes(self.max_tokens)
        limit = min(max(self._staged_fit(sizes), 1), left)
        return max((n for n in sizes if n <= limit), default=0)

    def _staged_fit(self, sizes: list[int]) -> int:
        """The most tokens a new staged chunk may have by the layer cost model."""
        if not self._staged:
            return self.FIRST_STAGED_CHUNK
        fixed, per_token, error = self.layer_cost_model()
        per_layer = self._slack(self.factor) / self.STAGED_TARGET_LAYERS
        if fixed + error >= per_layer:
            per_layer = self._slack(self.factor)  # one layer a step, then
        # At most one size above the largest measured: its first layer is a guess from
        # the line (on CPU, a first layer at twice the largest size made a 2.66x gap).
        largest = max(tokens for tokens, _ in self._staged)
        ceiling = next((n for n in sizes if n > largest), sizes[-1])
        # It grows only where the next size still fits with its cost scaled in proportion
        # from the largest size's own layers. On CPU a small chunk's layer costs about the
        # same at any size (the weights are read anyway) and a large one's grows with its
        # tokens; a line through the small sizes promised chunks whose first layer alone
        # overran the slack (384 tokens: 125-190 ms over a 25 ms slack).
        own = statistics.fmean(e for t, e in self._staged if t == largest)
        if own * ceiling / largest > per_layer:
            ceiling = largest
        usable = per_layer - fixed - error
        fits = min(int(usable / per_token), ceiling) if usable > 0 else largest
        # Nor a size at or past the smallest one whose own layers took more than a layer's
        # share (their mean plus spread; a layer costs no less for more tokens): smaller, in
        # proportion to that size's cost. The line, unable to tell its parts, may call the
        # cost all fixed and the mean of every size: on CPU deep in a 16k prompt, 96-token
        # chunks took 300 ms a layer over an 87 ms slack, and a new chunk kept that size.
        for size, cost in sorted(self._own_costs().items()):
            if cost > per_layer:
                return min(fits, int(size * per_layer / cost))
        return fits

    def _own_costs(self) -> dict[int, float]:
        """Each size in the window: the mean plus spread of its layers' cost."""
        by_size: dict[int, list[float]] = {}
        for tokens, extra in self._staged:
            by_size.setdefault(tokens, []).append(extra)
        return {t: statistics.fmean(e) + _pstdev(e) for t, e in by_size.items()}

    def staged_layers(self, num_tokens: int) -> int:
        """Layers of a staged chunk of `num_tokens` to run in the next step beside decodes;
        0 for a decode-only step first, to measure the normal gap."""
        if self._measure_first():
            return 0
        if not self._staged or num_tokens > max(t for t, _ in self._staged):
            return 1  # a size never measured: one layer shows what it costs
        fixed, per_token, error = self.layer_cost_model()
        per_layer = fixed + error + per_token * num_tokens
        # The line is fitted over every size; this size's own steps, where there are any,
        # may say it costs more (a CPU run ran 17 layers of a 32-token chunk in 359 ms
        # where the line promised 24 ms of slack).
        own = self._own_costs().get(num_tokens)
        if own is not None:
            per_layer = max(per_layer, own)
        # At most twice the layers this size ran in a step: the line's error adds up over
        # layers (a CPU run ran 23 layers of a 24-token chunk in 425 ms, 3.45x the gap).
        most = self._most_layers.get(num_tokens, 1)
        return max(1, min(int(self._slack(self.factor) / per_layer), 2 * most))

    def staged_slack(self) -> float | None:
        """Seconds a staged chunk's layers may add to a step beside decodes (None before
        the normal gap is measured)."""
        return self._slack(self.factor) if self.decode_step_s is not None else None

    def layer_cost_model(self) -> tuple[float, float, float]:
        """(fixed s, s per token, typical error s) of one layer of a staged chunk. Where
        chunks of several sizes show no slope that stands out, the cost counts as fixed:
        on CPU a step's noise (tens of ms) outweighs what a layer of a small chunk adds,
        and that noise taken as a cost per token made each smaller chunk look dearer,
        down to one token a chunk."""
        return _fit(list(self._staged), None, unclear_as_fixed=True)

    # ---- measurements -----------------------------------------------------------------

    def observe(
        self,
        num_decodes: int,
        num_prefill_tokens: int,
        seconds: float,
        staged: Sequence[tuple[int, int]] = (),
    ) -> None:
        """A finished step: its decodes, the prompt tokens it ran through every layer, and
        the (tokens, layers) of each chunk it ran through some of them (`staged`)."""
        if not num_decodes:
            # Says nothing about a decode's pace, but what prefill costs a token (through
            # every layer), where a chunk is long enough that the step's fixed costs do not
            # count: a staged one through a single layer too.
            if max([num_prefill_tokens, *(t for t, _ in staged)]) < self.PRIOR_MIN_TOKENS:
                return
            tokens = float(num_prefill_tokens)
            if staged:
                if self.num_layers is None:
                    return
                tokens += sum(t * layers for t, layers in staged) / self.num_layers
            self.prefill_token_s = self._ema(self.prefill_token_s, seconds / tokens)
            return
        if not num_prefill_tokens and not staged:
            self._decode_steps.append(seconds)
            self._since_measure, self._since_measure_s = 0, 0.0
            return
        normal = self.decode_step_s
        if normal is None:
            return
        # Not clipped at zero: decode-only steps vary around their median too (on CPU by
        # tens of ms), and clipped differences average to a cost where there is none.
        extra = seconds - normal
        self._since_measure += 1
        self._since_measure_s += seconds
        if not staged:
            self._mixed.append((num_prefill_tokens, extra))
        elif not num_prefill_tokens and len(staged) == 1:
            tokens, layers = staged[0]
            self._staged.append((tokens, extra / layers))
            self._most_layers[tokens] = max(layers, self._most_layers.get(tokens, 0))

    def _clamp(self, tokens: int, largest: int) -> int:
        return max(self.MIN_CHUNK, min(self.max_tokens, tokens, self.MAX_GROWTH * largest))

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.EMA) * old + self.EMA * new


def _fit(
    points: list[Point], prior_per_token: float | None, unclear_as_fixed: bool = False
) -> tuple[float, float, float]:
    """(fixed s, s per token, typical error s) of a line through (tokens, extra s) points.
    Without a slope that stands out from the noise, the cost is taken as all fixed where
    `unclear_as_fixed` and the points are of several sizes; else as all per token (the
    average), or, where `prior_per_token` is cheaper, as that slope plus the rest. (Points
    of one size show no slope, whatever the cost per token: taken as fixed, a chunk too
    large would keep its size for good.)"""
    mean_t = statistics.fmean(t for t, _ in points)
    mean_e = statistics.fmean(e for _, e in points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    fixed, per_token = 0.0, mean_e / mean_t
    slope = sum((t - mean_t) * (e - mean_e) for t, e in points) / spread if spread else 0.0
    intercept = mean_e - slope * mean_t
    clear = slope > 0 and _stands_out(points, slope, intercept, spread)
    if clear and intercept >= 0:
        fixed, per_token = intercept, slope
    elif not clear and unclear_as_fixed and spread > 0:
        fixed, per_token = mean_e, 0.0
    elif prior_per_token is not None and prior_per_token < per_token:
        # The sizes seen cannot separate the parts: take the slope prefill alone shows.
        fixed, per_token = mean_e - prior_per_token * mean_t, prior_per_token
    per_token = max(per_token, 1e-6)
    residuals = [e - fixed - per_token * t for t, e in points]
    error = _pstdev(residuals) if len(residuals) > 1 else 0.0
    return fixed, per_token, error


def _pstdev(values: list[float]) -> float:
    """Population standard deviation in floats: statistics.pstdev works in exact fractions,
    90 us for 32 values, and the scheduler computes two a staged step."""
    mean = statistics.fmean(values)
    return math.sqrt(statistics.fmean([(v - mean) ** 2 for v in values]))


def _stands_out(points: list[Point], slope: float, intercept: float, spread: float) -> bool:
    """Whether a fitted slope is more than twice its standard error. Chunks of nearly one
    size fit a slope that is mostly step-time noise, and a slope too steep holds chunks at
    one token for as long as it stays in the window."""
    if len(points) < 3:
        return False
    squares = sum((e - intercept - slope * t) ** 2 for t, e in points)
    return slope > 2 * math.sqrt(squares / (len(points) - 2) / spread)
