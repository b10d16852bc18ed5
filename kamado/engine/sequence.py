"""A sequence: one choice of one request, with its tokens, KV blocks and progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kamado.engine.outputs import TokenLogprob
from kamado.engine.sampling_params import SamplingParams
from kamado.models.transformer import split_state

if TYPE_CHECKING:
    from kamado.kv.block_tokens import TokenMatch
    from kamado.kv.tier_transfers import Restore
    from kamado.models.transformer import LayerState, StepContext


@dataclass
class StagedChunk:
    """A prompt chunk computed a few layers per step: its K/V is written up to
    `next_layer`, and its residual stream waits in `state` for the layers after.
    `context`: its attention metadata, the same for each of its steps in a pass of its own
    (built once: its block table at a 120k context took 0.75 ms of the host a step).
    `rest`: the tokens right after these, split off where a layer of the whole chunk took
    more than its step could give (see LayerClock.tokens_to_keep); they wait at their own
    `next_layer` until these are through every layer, then go on from there (causal: they
    attend to these tokens' K/V, all of which is written by then).
    `alone`: started while nothing decoded, so sized for steps of its own rather than for
    the slack beside decodes (see Scheduler._stage)."""

    num_tokens: int
    next_layer: int = 0
    state: LayerState | None = None
    context: StepContext | None = None
    rest: StagedChunk | None = None
    alone: bool = False

    def split(self, keep: int) -> None:
        """Go on with the first `keep` tokens; the others wait in `rest`, ahead of any
        tokens that were waiting there already."""
        assert self.state is not None and 0 < keep < self.num_tokens
        self.state, rest_state = split_state(self.state, keep)
        self.rest = StagedChunk(
            self.num_tokens - keep, self.next_layer, rest_state, rest=self.rest, alone=self.alone
        )
        self.num_tokens, self.context = keep, None  # the context was built for all of them


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
