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

Cost: a decode/verify step takes `fixed + per_token * tokens` seconds, fitted over recent
steps without prefill (on CPU per-token cost is a large share; on a GPU a step is
bandwidth-bound and extra tokens are nearly free until the batch is large).

Choice: the expected tokens per second of a step, (B + sum of expected accepted) /
(fixed + per_token * (B + sum of draft lengths)), grows by adding the draft position with
the largest gain r**j as long as r**j > per_token * (current tokens per second). Adding
them greedily in that order maximises the expected rate; as the batch B grows the bar
rises and speculation shrinks, and it turns off where it would not pay.
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
# per_token / fixed until the step cost has been fitted. The H200 figure
# (bench/results/2026-11-30-spec-verify-h200.json) is far lower; CPUs are higher.
PRIOR_TOKEN_SHARE = 0.05
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


class StepCost:
    """Fits step seconds = fixed + per_token * tokens over recent decode/verify steps."""

    def __init__(self) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=COST_WINDOW)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self._steps.append((num_tokens, seconds))

    def model(self) -> tuple[float, float]:
        """(fixed s, per-token s); relative units from the prior until fitted.

        Fitted on the median time of each token count, so a step slowed by something
        else on the machine does not tilt the line."""
        if len(self._steps) < MIN_COST_SAMPLES:
            return 1.0, PRIOR_TOKEN_SHARE
        by_tokens: dict[int, list[float]] = {}
        for tokens, seconds in self._steps:
            by_tokens.setdefault(tokens, []).append(seconds)
        if len(by_tokens) > 1:
            counts = list(by_tokens)
            medians = [statistics.median(by_tokens[t]) for t in counts]
            slope, intercept = statistics.linear_regression(counts, medians)
            if slope > 0 and intercept > 0:
                return intercept, slope
        fixed = statistics.median(s / (1 + PRIOR_TOKEN_SHARE * t) for t, s in self._steps)
        return fixed, fixed * PRIOR_TOKEN_SHARE


@dataclass
class SeqRates:
    by_proposer: dict[str, Rate] = field(default_factory=dict)


class Controller:
    def __init__(self, max_draft: int) -> None:
        self.max_draft = max_draft
        self.cost = StepCost()
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
        in a step of `batch_size` decodes (the bar rises as drafts are added, so this is
        an upper bound)."""
        fixed, per_token = self.cost.model()
        bar = per_token * batch_size / (fixed + per_token * batch_size)
        if rate <= bar:
            return 0
        if rate >= 1.0:
            return self.max_draft
        return min(
            self.max_draft, int(math.log(bar) / math.log(rate)) if bar > 0 else self.max_draft
        )

    def draft_lengths(self, batch_size: int, candidates: list[Candidate | None]) -> list[int]:
        """Draft tokens to verify for each of a step's `batch_size` decoding sequences
        (`candidates` lists those that have a draft, None for the rest)."""
        fixed, per_token = self.cost.model()
        lengths = [0] * len(candidates)
        tokens, expected = float(batch_size), float(batch_size)
        # Gains r**j, largest first; each sequence offers its next position after the last.
        heap = [(-c.rate, i, 1) for i, c in enumerate(candidates) if c and c.draft]
        heapq.heapify(heap)
        while heap:
            neg_gain, i, j = heapq.heappop(heap)
            gain = -neg_gain
            if gain <= per_token * expected / (fixed + per_token * tokens):
                break
            lengths[i] = j
            tokens += 1
            expected += gain
            candidate = candidates[i]
            assert candidate is not None
            if j < min(len(candidate.draft), self.max_draft):
                heapq.heappush(heap, (-(gain * candidate.rate), i, j + 1))
        return lengths
