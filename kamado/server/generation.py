"""One request's trip through the engine: detokenize each choice, apply stop strings, time it,
and make sure the engine forgets it (KV freed) however the trip ends.

If the engine dies or is replaced after a hang, the trip goes on: once the supervisor has a
new engine up, each unfinished choice continues there from its prompt plus the tokens it
already had, so a client sees neither a repeated nor a missing token.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import anyio

from kamado.engine.async_engine import EngineDeadError
from kamado.engine.detokenizer import TextStream
from kamado.engine.outputs import TokenDelta, TokenLogprob
from kamado.engine.sampling_params import SamplingParams
from kamado.server.state import ServerState

log = logging.getLogger("kamado.server")

# An engine that died this many times under one request was probably killed by it.
MAX_RESUMES = 2
# How long a request waits for the supervisor to bring a new engine up.
RESUME_WAIT_S = 300.0


class GenerationError(RuntimeError):
    """The engine could not finish the request (it died, or aborted it on its own)."""


@dataclass
class ChoiceUpdate:
    index: int
    text: str  # newly final text of this choice
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None  # "stop" | "length" when the choice is done


class Generation:
    def __init__(
        self,
        state: ServerState,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        endpoint: str,
        arrival: float | None = None,  # time.monotonic() when the request came in
        session: str | None = None,  # agent session key, for the prefix cache
    ) -> None:
        self.state = state
        self.engine = state.engine  # the supervisor may replace state.engine meanwhile
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.session = session
        self.endpoint = endpoint
        self.arrival = time.monotonic() if arrival is None else arrival
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_cached_tokens = 0
        self.output_token_ids: list[list[int]] = [[] for _ in range(params.n)]
        self.num_resumes = 0

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.output_token_ids)

    async def _abort(self) -> None:
        # Shielded: this runs while the task is being cancelled (client went away).
        with anyio.CancelScope(shield=True):
            with contextlib.suppress(Exception):
                await self.engine.abort(self.request_id)

    async def updates(self) -> AsyncIterator[ChoiceUpdate]:
        n = self.params.n
        metrics = self.state.metrics
        tokenizer, prompt = self.state.tokenizer, self.prompt_token_ids
        streams = [TextStream(tokenizer, self.params, prompt) for _ in range(n)]
        done = [False] * n  # the choice is over for the client
        engine_done = [False] * n  # the engine has released the choice
        last_token_at: list[float | None] = [None] * n
        first_token_seen = False
        outcome = "error"
        try:
            async for delta in self._deltas(done):
                i = delta.index
                engine_done[i] = engine_done[i] or delta.finished
                self.num_cached_tokens = max(self.num_cached_tokens, delta.num_cached_tokens)
                if done[i]:
                    if all(engine_done):
                        break
                    continue  # stopped by a stop string; the engine has not heard yet
                if delta.finish_reason == "abort":
                    raise GenerationError("the engine aborted the request")
                stream = streams[i]
                text = stream.add(delta.new_token_ids) if delta.new_token_ids else ""
                new = delta.new_token_ids[: stream.num_used]
                logprobs = delta.logprobs[: len(new)] if delta.logprobs is not None else None
                now = time.monotonic()
                if new:
                    if not first_token_seen:
                        first_token_seen = True
                        metrics.ttft.observe(now - self.arrival)
                    prev = last_token_at[i]
                    if prev is not None:
                        gap = (now - prev) / len(new)
                        for _ in new:
                            metrics.itl.observe(gap)
                    last_token_at[i] = now
                    self.output_token_ids[i].extend(new)
                finish = delta.finish_reason
                if stream.stopped:
                    finish = "stop"
                elif finish is not None:
                    text += stream.flush()
                if finish is not None:
                    done[i] = True
                yield ChoiceUpdate(i, text, new, logprobs, finish)
                if all(done):
                    break
                if stream.stopped and not engine_done[i]:
                    # Free this choice's KV now; the engine sends no delta for an abort.
                    await self.engine.abort(self.request_id, i)
                    engine_done[i] = True
            else:
                if not all(done):
                    raise GenerationError("the engine ended the request without finishing it")
            outcome = "ok"
        except (anyio.get_cancelled_exc_class(), GeneratorExit):
            outcome = "cancelled"  # the client went away
            raise
        finally:
            if not all(engine_done):
                await self._abort()
            metrics.e2e.observe(time.monotonic() - self.arrival)
            metrics.requests.labels(self.endpoint, outcome).inc()

    async def _deltas(self, done: list[bool]) -> AsyncIterator[TokenDelta]:
        """The engine's deltas for this request, across engine restarts: after one, the
        choices not yet `done` continue on the new engine from the tokens they have."""
        continue_from: dict[int, list[int]] | None = None
        while True:
            try:
                async for delta in self.engine.generate(
                    self.request_id, self.prompt_token_ids, self.params, self.session, continue_from
                ):
                    yield delta
                return
            except EngineDeadError as e:
                if self.num_resumes == MAX_RESUMES:
                    raise GenerationError(
                        f"the engine failed {MAX_RESUMES + 1} times while serving this request"
                    ) from e
                self.num_resumes += 1
                self.engine = await self._next_engine(self.engine)
                continue_from = {
                    i: list(tokens) for i, tokens in enumerate(self.output_token_ids) if not done[i]
                }
                self.state.metrics.resumed_requests.inc()
                log.warning(
                    "request %s continues on the restarted engine (%d token(s) kept)",
                    self.request_id,
                    sum(len(t) for t in continue_from.values()),
                )

    async def _next_engine(self, dead: Any) -> Any:
        deadline = time.monotonic() + RESUME_WAIT_S
        while time.monotonic() < deadline:
            engine = self.state.engine
            if engine is not dead and engine.stats().alive:
                return engine
            await asyncio.sleep(0.2)
        raise GenerationError(f"the engine did not come back within {RESUME_WAIT_S:.0f} s")
