"""A sequence: one choice of one request, with its tokens, KV blocks and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.engine.outputs import TokenLogprob
from kamado.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kamado.kv.block_tokens import TokenMatch
    from kamado.kv.tier_transfers import Restore
    from kamado.models.transformer import LayerState, StepContext


@dataclass
class StagedChunk:
    """A prompt chunk computed a few layers per step beside decodes: its K/V is written
    up to `next_layer`, and its residual stream waits in `state` for the layers after.
    `context`: its attention metadata, the same for each of its steps in a pass of its own
    (built once: its block table at a 120k context took 0.75 ms of the host a step)."""

    num_tokens: int
    next_layer: int = 0
    state: LayerState | None = None
    context: StepContext | None = None


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n choices
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; preemption takes the newest first
    token_ids: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0  # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    session: str | None = None  # the agent session: prefix-cache eviction, fair admission
    preempted: bool = False  # it ran and lost its KV; it is admitted again before new ones
    block_keys: list[bytes] = field(default_factory=list)  # content keys of its full blocks
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    # Cached blocks coming back from host RAM or disk; it waits until they are.
    restore: Restore | None = None
    # A cached block to copy the first tokens of once its blocks are in (pinned till then).
    partial: TokenMatch | None = None
    # Choices 1..n-1 of a request wait here until choice 0 has prefilled the shared prompt.
    pending_forks: list[Sequence] = field(default_factory=list)
    # A prompt chunk part way through the layers; its tokens count as computed once done.
    staged: StagedChunk | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed
