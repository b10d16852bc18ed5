"""How many draft tokens each sequence verifies this step, from measured acceptance and
measured step cost.

Acceptance: a proposer's draft is modelled as accepted token by token with probability r
(the verification stops at the first miss), so drafting j tokens yields sum(r**i, i<=j)
tokens beyond the one every step emits. r is estimated per sequence and proposer from
decayed counts (accepted tokens over tokens tried), with the proposer's rate over all
recent sequences as the prior. Every proposer's draft is scored against the tokens each
step emits, the chosen one's and the others', with or without verification, so a
proposer (or a sequence) that stopped drafting keeps being measured and comes back when
its drafts would be accepted again.

Cost: a step without prefill takes `fixed + per_token * tokens` seconds, plus `extra`
when it verifies drafts, all fitted over recent steps. `extra` is what taking the
verification path costs at all: on CUDA a plain decode step replays a CUDA graph while a
verification runs eagerly, about 3x the time of a graph step for an 8B model on the H200
whatever k is (bench/results/2026-11-30-spec-verify-h200.json); on CPU both paths are
the same and `extra` is about zero, while per-token cost is a large share.

Choice: the expected tokens per second of a step, (B + sum of expected accepted) /
(fixed + extra + per_token * (B + sum of draft lengths)), grows by adding the draft
position with the largest gain r**j as long as r**j > per_token * (current tokens per
second). Adding them greedily in that order maximises the expected rate; the result is
then kept only if it beats a plain step's B / (fixed + per_token * B). As the batch B
grows the bar rises and speculation shrinks, and it turns off where it would not pay.
"""

from __future__ import annotations

import heapq
import math
import statistics
from collections import deque
from dataclasses import dataclass, field

PRIOR_RATE = 0.5  # acceptance assumed for a proposer never measured
PRIOR_WEIGHT = 2.0  # pseudo-trials the prior counts for, per sequence
SEQ_DECAY = 0.8  # weight kept by a sequence's counts per step
GLOBAL_DECAY = 0.995
# Until the step cost is fitted: per_token / fixed and extra / fixed, by device type. CUDA
# from the H200 measurement above (8B shapes, batch 1-16); CPU from a 2-core machine.
PRIORS = {"cuda": (0.005, 2.2), "cpu": (0.05, 0.0)}
COST_WINDOW = 64
MIN_COST_SAMPLES = 8


@dataclass
class Rate:
    """Decayed counts of accepted tokens and tokens tried."""

    accepted: float = 0.0
    tried: float = 0.0

    def add(self, num_accepted: int, missed: bool, decay: float) -> None:
        self.accepted = decay * self.accepted + num_accepted
        self.tried = decay * self.tried + num_accepted + missed

    def estimate(self, prior: float, weight: float) -> float:
        return (self.accepted + prior * weight) / (self.tried + weight)


@dataclass
class Candidate:
    """A sequence's best draft this step and its estimated per-token acceptance."""

    draft: list[int]
    rate: float
    proposer: str


@dataclass
class CostModel:
    fixed: float  # seconds of a step of no tokens (relative units from the priors)
    per_token: float  # seconds per token
    extra: float  # seconds more when the step verifies drafts

    def seconds(self, tokens: float, verifies: bool) -> float:
        return self.fixed + self.per_token * tokens + (self.extra if verifies else 0.0)


class StepCost:
    """Fits the cost model over recent steps: plain steps give `fixed` and `per_token`,
    verification steps what they cost beyond that line. Each line is fitted on the median
    time per token count, so a step slowed by something else on the machine does not
    tilt it."""

    def __init__(self, device: str = "cpu") -> None:
        self.token_share, self.extra_share = PRIORS["cuda" if device.startswith("cuda") else "cpu"]
        self._plain: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        self._verify: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)
        # Refitted once per observed step, not per sequence asking (64 asks a step at batch 64).
        self._model: CostModel | None = None

    def observe(self, num_tokens: int, num_drafted: int, seconds: float) -> None:
        (self._verify if num_drafted else self._plain).append((num_tokens, seconds))
        self._model = None

    def model(self) -> CostModel:
        if self._model is None:
            self._model = self._fit()
        return self._model

    def _fit(self) -> CostModel:
        plain, verify = self._line(self._plain), self._line(self._verify)
        if plain is not None:
            fixed, per_token = plain
            if verify is None:
                return CostModel(fixed, per_token, self.extra_share * fixed)
            extra = statistics.median(s - fixed - per_token * t for t, s in self._verify)
            return CostModel(fixed, per_token, max(extra, 0.0))
        if verify is not None:  # always verifying: split the intercept by the prior
            intercept, per_token = verify
            fixed = intercept / (1 + self.extra_share)
            return CostModel(fixed, per_token, intercept - fixed)
        return CostModel(1.0, self.token_share, self.extra_share)

    def _line(self, steps: deque[tuple[int, float]]) -> tuple[float, float] | None:
        if len(steps) < MIN_COST_SAMPLES:
            return None
        by_tokens: dict[int, list[float]] = {}
        for tokens, seconds in steps:
            by_tokens.setdefault(tokens, []).append(seconds)
        if len(by_tokens) > 1:
            counts = list(by_tokens)
            medians = [statistics.median(by_tokens[t]) for t in counts]
            slope, intercept = statistics.linear_regression(counts, medians)
            if slope > 0 and intercept > 0:
                return intercept, slope
        fixed = statistics.median(s / (1 + self.token_share * t) for t, s in steps)
        return fixed, fixed * self.token_share


@dataclass
class SeqRates:
    by_proposer: dict[str, Rate] = field(default_factory=dict)


class Controller:
    def __init__(self, max_draft: int, device: str = "cpu") -> None:
        self.max_draft = max_draft
        self.cost = StepCost(device)
        self.global_rates: dict[str, Rate] = {}

    def rate(self, seq_rates: SeqRates, proposer: str) -> float:
        prior = self.global_rates.get(proposer, Rate()).estimate(PRIOR_RATE, 1.0)
        return seq_rates.by_proposer.get(proposer, Rate()).estimate(prior, PRIOR_WEIGHT)

    def observe(
        self, seq_rates: SeqRates, proposer: str, draft: list[int], emitted: list[int]
    ) -> None:
        """Score a draft against the tokens the step emitted: accepted up to the first
        difference; a miss only if that difference was seen (within both)."""
        accepted = 0
        while accepted < min(len(draft), len(emitted)) and draft[accepted] == emitted[accepted]:
            accepted += 1
        missed = accepted < min(len(draft), len(emitted))
        seq_rates.by_proposer.setdefault(proposer, Rate()).add(accepted, missed, SEQ_DECAY)
        self.global_rates.setdefault(proposer, Rate()).add(accepted, missed, GLOBAL_DECAY)

    def useful_length(self, rate: float, batch_size: int) -> int:
        """The longest draft the controller could verify for a sequence accepted at `rate`
        in a step of `batch_size` decodes (the bar only rises as drafts are added)."""
        cost = self.cost.model()
        bar = cost.per_token * batch_size / cost.seconds(batch_size, verifies=True)
        if rate <= bar:
            return 0
        if rate >= 1.0 or bar <= 0.0:
            return self.max_draft
        return min(self.max_draft, int(math.log(bar) / math.log(rate)))

    def draft_lengths(self, batch_size: int, candidates: list[Candidate | None]) -> list[int]:
        """Draft tokens to verify for each of a step's `batch_size` decoding sequences
        (`candidates` lists those that have a draft, None for the rest)."""
        cost = self.cost.model()
        lengths = [0] * len(candidates)
        tokens, expected = float(batch_size), float(batch_size)
        # Gains r**j, largest first; each sequence offers its next position after the last.
        heap = [(-c.rate, i, 1) for i, c in enumerate(candidates) if c and c.draft]
        heapq.heapify(heap)
        while heap:
            neg_gain, i, j = heapq.heappop(heap)
            gain = -neg_gain
            if gain <= cost.per_token * expected / cost.seconds(tokens, verifies=True):
                break
            lengths[i] = j
            tokens += 1
            expected += gain
            candidate = candidates[i]
            assert candidate is not None
            if j < min(len(candidate.draft), self.max_draft):
                heapq.heappush(heap, (-(gain * candidate.rate), i, j + 1))
        plain_rate = batch_size / cost.seconds(batch_size, verifies=False)
        if expected / cost.seconds(tokens, verifies=True) <= plain_rate:
            return [0] * len(candidates)
        return lengths
