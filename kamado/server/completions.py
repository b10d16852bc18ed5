"""POST /v1/completions: a raw prompt (text or token ids) continued, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from kamado.engine.outputs import TokenLogprob
from kamado.engine.sampling_params import SamplingParams
from kamado.server.decoding import decode_body, read_body
from kamado.server.errors import APIError
from kamado.server.generation import Generation
from kamado.server.output_constraints import output_constraint
from kamado.server.protocol import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
    new_id,
    now,
)
from kamado.server.request_params import fit_max_tokens, sampling_params
from kamado.server.respond import respond
from kamado.server.state import ServerState
from kamado.server.streaming import sse

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


@dataclass
class PreparedCompletion:
    req: CompletionRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    headers: dict[str, str] = field(default_factory=dict)


def _single_prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, int) for p in prompt):
        return list(prompt)
    if len(prompt) == 1:
        return prompt[0]
    raise APIError(
        "prompt must be one string or one list of token ids; batched prompts are not supported "
        "(send one request per prompt).",
        param="prompt",
    )


def _check_ids(ids: list[int], vocab_size: int | None) -> None:
    if not ids:
        raise APIError("prompt is empty.", param="prompt")
    bad = [t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise APIError(
            f"prompt contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
            param="prompt",
        )


async def prepare(state: ServerState, raw: bytes) -> PreparedCompletion:
    req = decode_body(raw, CompletionRequest)
    state.check_model(req.model)
    if req.echo:
        raise APIError("echo is not supported by this server.", param="echo")
    if req.suffix:
        raise APIError("suffix (insert mode) is not supported by this server.", param="suffix")
    prompt = _single_prompt(req.prompt)
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("prompt is empty.", param="prompt")
        ids = await asyncio.to_thread(state.template.tokenize, prompt, True)
    else:
        ids = prompt
    _check_ids(ids, state.vocab_size)
    budget = fit_max_tokens(len(ids), state.max_model_len, req.max_tokens, DEFAULT_MAX_TOKENS)
    constraint = await output_constraint(req)
    params = sampling_params(
        req, budget.max_tokens, req.logprobs, state.stop_token_ids, state.vocab_size, constraint
    )
    headers = {}
    if budget.clamped_from is not None:
        headers["x-kamado-max-tokens-clamped"] = str(budget.max_tokens)
    return PreparedCompletion(req, ids, params, headers)


class _Logprobs:
    """OpenAI's legacy logprobs object, grown as tokens arrive."""

    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.offset = 0

    def format(self, lps: list[TokenLogprob] | None) -> CompletionLogprobs:
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for lp in lps or []:
            tok, _ = self.state.token_text.get(lp.token_id)
            out.tokens.append(tok)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.state.token_text.get(t)[0]: v for t, v in lp.top})
            out.text_offset.append(self.offset)
            self.offset += len(tok)
        return out

    @staticmethod
    def extend(a: CompletionLogprobs, b: CompletionLogprobs) -> None:
        a.tokens += b.tokens
        a.token_logprobs += b.token_logprobs
        a.top_logprobs = (a.top_logprobs or []) + (b.top_logprobs or [])
        a.text_offset += b.text_offset


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


async def _collect(state: ServerState, gen: Generation) -> Completion:
    n = gen.params.n
    texts: list[list[str]] = [[] for _ in range(n)]
    reasons: list[str | None] = [None] * n
    want_lp = gen.params.logprobs is not None
    fmt = [_Logprobs(state) for _ in range(n)]
    lps = [fmt[i].format([]) for i in range(n)]
    async with aclosing(gen.updates()) as updates:
        async for up in updates:
            texts[up.index].append(up.text)
            if want_lp:
                _Logprobs.extend(lps[up.index], fmt[up.index].format(up.logprobs))
            if up.finish_reason is not None:
                reasons[up.index] = up.finish_reason
    choices = [
        CompletionChoice(
            index=i,
            text="".join(texts[i]),
            logprobs=lps[i] if want_lp else None,
            finish_reason=reasons[i],
        )
        for i in range(n)
    ]
    return Completion(
        id=gen.request_id, created=now(), model=state.model_name, choices=choices, usage=_usage(gen)
    )


async def _stream(
    state: ServerState, prep: PreparedCompletion, gen: Generation
) -> AsyncIterator[str]:
    created = now()
    want_lp = gen.params.logprobs is not None
    fmt = [_Logprobs(state) for _ in range(gen.params.n)]

    def chunk(choices: list[dict[str, Any]], usage: Usage | None = None) -> str:
        body: dict[str, Any] = {
            "id": gen.request_id,
            "object": "text_completion",
            "created": created,
            "model": state.model_name,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    async with aclosing(gen.updates()) as updates:
        async for up in updates:
            if not up.text and up.finish_reason is None and not want_lp:
                continue
            lp = fmt[up.index].format(up.logprobs).model_dump() if want_lp else None
            choice = {"index": up.index, "text": up.text, "logprobs": lp}
            yield chunk([{**choice, "finish_reason": up.finish_reason}])
    if prep.req.include_usage:
        yield chunk([], _usage(gen))


async def create_completion(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    prep = await prepare(state, await read_body(request))
    state.check_alive()
    lease = state.acquire()
    gen = Generation(
        state,
        new_id("cmpl"),
        prep.prompt_token_ids,
        prep.params,
        "completions",
        arrival,
        session=prep.req.session_key,
    )
    return await respond(
        request, lease, prep.headers, prep.req.stream,
        events=lambda: _stream(state, prep, gen), collect=lambda: _collect(state, gen),
        heartbeat_s=state.options.heartbeat_s,
    )  # fmt: skip
