"""What the engine hands back: token deltas from the core, whole results from the LLM API."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    # The most likely tokens at this position, best first: (token_id, logprob).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class TokenDelta:
    """New tokens of one sequence (choice `index` of request `request_id`) from one step."""

    request_id: str
    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" when done
    num_prompt_tokens: int
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
