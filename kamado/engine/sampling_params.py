"""Per-request sampling parameters, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, field

from kamado.structured.constraint import Constraint

MAX_STOP_STRINGS = 64
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 1024  # entries: each step adds them to the logits, beside every stream
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, +100 all but forces it


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the chosen token's logprob plus the k most likely.
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Grammar the output must follow (JSON schema, regex, Lark); None = free text.
    constraint: Constraint | None = None
    # Added to the token's logit before sampling (OpenAI's logit_bias); logprobs stay those
    # of the model's own distribution, as with the penalties.
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """Penalties or a logit bias change the logits before a token is picked."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or bool(self.logit_bias)
        )

    def validate(self) -> None:
        """Raise ValueError naming the parameter and its allowed range."""
        checks = [
            (1 <= self.n <= 16, "n must be between 1 and 16"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens must be at least 1",
            ),
            (0.0 <= self.temperature <= 2.0, "temperature must be between 0 and 2"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (self.top_k >= 0 or self.top_k == -1, "top_k must be >= 0 (0 or -1 = off)"),
            (0.0 <= self.min_p <= 1.0, "min_p must be between 0 and 1"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be between -2 and 2"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be between -2 and 2"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (len(self.stop) <= MAX_STOP_STRINGS, f"at most {MAX_STOP_STRINGS} stop strings"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}",
            ),
            (
                self.seed is None or -(2**63) <= self.seed < 2**64,
                "seed must fit in 64 bits",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS,
                f"logit_bias may have at most {MAX_LOGIT_BIAS} entries",
            ),
            (
                all(-LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE for v in self.logit_bias.values()),
                f"logit_bias values must be between {-LOGIT_BIAS_RANGE:g} and {LOGIT_BIAS_RANGE:g}",
            ),
            (
                all(t >= 0 for t in self.logit_bias),
                "logit_bias keys must be token ids (non-negative integers)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.top_k == -1:
            self.top_k = 0
