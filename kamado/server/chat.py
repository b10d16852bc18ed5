"""POST /v1/chat/completions: messages -> prompt -> engine -> text and tool calls, streamed or not.

tool_choice:
- "none": tools are neither rendered nor parsed.
- "auto" (also when tools come without tool_choice, CLIENTS.md 1): tools rendered; tagged
  calls parsed, and bare-JSON replies unless --no-bare-json-tool-calls.
- "required" / a named function: decoding is constrained to the template's call format
  (output_constraints.py), so the reply is always calls of the allowed tools whose arguments
  fit their schemas; a named function, or parallel_tool_calls: false, allows one call only.
"""

from __future__ import annotations

import asyncio
import time
import uuid
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
from kamado.server.output_constraints import ToolConstraint, output_constraint
from kamado.server.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    ChatTokenLogprob,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    TopLogprob,
    Usage,
    new_id,
    now,
)
from kamado.server.request_params import fit_max_tokens, sampling_params
from kamado.server.respond import respond
from kamado.server.state import ServerState
from kamado.server.streaming import sse
from kamado.server.tool_calls import (
    ArgumentsEvent,
    CallEvent,
    CallStartEvent,
    Event,
    TextEvent,
    ToolCallParser,
    declared_tools,
)


@dataclass
class ToolPlan:
    tools: dict[str, Any]  # name -> parameters schema, of tools the reply may call
    bare_json: bool
    forced: bool = False  # required / named: decoding is constrained to calls


@dataclass
class PreparedChat:
    req: ChatCompletionRequest
    prompt_token_ids: list[int]
    tool_plan: ToolPlan | None
    params: SamplingParams
    headers: dict[str, str] = field(default_factory=dict)


def _tool_plan(req: ChatCompletionRequest, state: ServerState) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none", "auto"):
            raise APIError(
                "tool_choice requires tools: send the functions in `tools`.", param="tool_choice"
            )
        return None
    if choice == "none":
        return None
    tools = declared_tools(req.tools)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in tools:
            raise APIError(
                f"tool_choice names function {name!r}, which is not among the declared tools "
                f"({', '.join(tools)}).",
                param="tool_choice",
            )
        return ToolPlan(declared_tools(req.tools, only=name), True, forced=True)
    if choice == "required":
        return ToolPlan(tools, True, forced=True)
    return ToolPlan(tools, state.options.bare_json_tool_calls)


def _tool_constraint(
    req: ChatCompletionRequest, plan: ToolPlan | None, state: ServerState
) -> ToolConstraint | None:
    if plan is None:
        return None
    return ToolConstraint(
        tools=plan.tools,
        declared=list(declared_tools(req.tools)),
        fmt=state.tool_format,
        tags_are_tokens=state.template.tool_tags_are_tokens,
        # A named function is called exactly once, as OpenAI's API does.
        parallel=req.parallel_tool_calls is not False
        and not isinstance(req.tool_choice, NamedToolChoice),
        forced=plan.forced,
        strict=any(t.function.strict for t in req.tools or [] if t.function.name in plan.tools),
    )


async def prepare(state: ServerState, raw: bytes) -> PreparedChat:
    """Everything that can be wrong with a request is found here, before any header is sent."""
    req = decode_body(raw, ChatCompletionRequest)
    state.check_model(req.model)
    if not req.messages:
        raise APIError("messages must contain at least one message.", param="messages")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError("top_logprobs requires logprobs: true.", param="top_logprobs")
    plan = _tool_plan(req, state)
    constraint = await output_constraint(
        req, req.response_format, _tool_constraint(req, plan, state)
    )
    tools = req.tools if req.tools and req.tool_choice != "none" else None
    # Rendering and tokenizing a 100k-token conversation takes a while: keep it off the loop.
    text = await asyncio.to_thread(
        state.template.render, req.messages, tools, req.chat_template_kwargs
    )
    prompt = await asyncio.to_thread(state.template.tokenize, text)
    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    budget = fit_max_tokens(len(prompt), state.max_model_len, requested, default=None)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(
        req, budget.max_tokens, top, state.stop_token_ids, state.vocab_size, constraint
    )
    headers = {}
    if budget.clamped_from is not None:
        headers["x-kamado-max-tokens-clamped"] = str(budget.max_tokens)
    return PreparedChat(req, prompt, plan, params, headers)


class ChoiceBuilder:
    """One choice of a reply: tool-call parsing and logprob formatting as text arrives."""

    def __init__(self, index: int, plan: ToolPlan | None, state: ServerState) -> None:
        self.index = index
        self.state = state
        self.parser = (
            ToolCallParser(plan.tools, plan.bare_json, state.tool_format, plan.forced)
            if plan
            else None
        )
        self._started_id: str | None = None  # id of a call whose name is already streamed
        self.content: list[str] = []
        self.calls: list[ResponseToolCall] = []
        self.logprobs: list[ChatTokenLogprob] = []
        self.finish_reason: str | None = None

    def events(self, text: str, final: bool) -> list[Event]:
        if self.parser is None:
            return [TextEvent(text)] if text else []
        events = self.parser.feed(text) if text else []
        if final:
            events += self.parser.finish()
        return events

    def start_call(self) -> str:
        self._started_id = f"call_{uuid.uuid4().hex[:24]}"
        return self._started_id

    def call(self, ev: CallEvent) -> ResponseToolCall:
        call = ResponseToolCall(
            id=self._started_id or f"call_{uuid.uuid4().hex[:24]}",
            function=ResponseFunctionCall(name=ev.name, arguments=ev.arguments),
        )
        self._started_id = None
        self.calls.append(call)
        if ev.bare:
            self.state.metrics.bare_json_tool_calls.inc()
        return call

    def format_logprobs(self, lps: list[TokenLogprob] | None) -> list[ChatTokenLogprob]:
        out = []
        for lp in lps or []:
            tok, raw = self.state.token_text.get(lp.token_id)
            top = []
            for tid, val in lp.top:
                t, b = self.state.token_text.get(tid)
                top.append(TopLogprob(token=t, logprob=val, bytes=b))
            out.append(ChatTokenLogprob(token=tok, logprob=lp.logprob, bytes=raw, top_logprobs=top))
        return out

    def final_reason(self, engine_reason: str) -> str:
        # A reply cut at max_tokens says so, even after complete calls.
        return "tool_calls" if self.calls and engine_reason != "length" else engine_reason


def _usage(gen: Generation) -> Usage:
    return Usage.of(gen.num_prompt_tokens, gen.num_completion_tokens, gen.num_cached_tokens)


async def _collect(state: ServerState, prep: PreparedChat, gen: Generation) -> ChatCompletion:
    n = gen.params.n
    builders = [ChoiceBuilder(i, prep.tool_plan, state) for i in range(n)]
    async with aclosing(gen.updates()) as updates:
        async for up in updates:
            b = builders[up.index]
            if gen.params.logprobs is not None:
                b.logprobs += b.format_logprobs(up.logprobs)
            for ev in b.events(up.text, up.finish_reason is not None):
                if isinstance(ev, TextEvent):
                    b.content.append(ev.text)
                elif isinstance(ev, CallEvent):
                    b.call(ev)
            if up.finish_reason is not None:
                b.finish_reason = b.final_reason(up.finish_reason)
    choices = []
    for b in builders:
        content: str | None = "".join(b.content)
        if b.calls and not content.strip():
            content = None
        choices.append(
            ChatChoice(
                index=b.index,
                message=ResponseMessage(content=content, tool_calls=b.calls or None),
                logprobs=ChatLogprobs(content=b.logprobs)
                if gen.params.logprobs is not None
                else None,
                finish_reason=b.finish_reason,
            )
        )
    return ChatCompletion(
        id=gen.request_id, created=now(), model=state.model_name, choices=choices, usage=_usage(gen)
    )


async def _stream(state: ServerState, prep: PreparedChat, gen: Generation) -> AsyncIterator[str]:
    created = now()
    n = gen.params.n
    want_lp = gen.params.logprobs is not None

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None, lps: Any = None) -> str:
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish}
        choice["logprobs"] = {"content": [lp.model_dump() for lp in lps]} if lps else None
        return sse(
            {
                "id": gen.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
            }
        )

    builders = [ChoiceBuilder(i, prep.tool_plan, state) for i in range(n)]
    for i in range(n):
        yield chunk(i, {"role": "assistant", "content": ""})
    pending_lps: list[list[ChatTokenLogprob]] = [[] for _ in range(n)]
    async with aclosing(gen.updates()) as updates:
        async for up in updates:
            b = builders[up.index]
            if want_lp:
                pending_lps[up.index] += b.format_logprobs(up.logprobs)
            for ev in b.events(up.text, up.finish_reason is not None):
                if isinstance(ev, TextEvent):
                    yield chunk(up.index, {"content": ev.text}, lps=pending_lps[up.index])
                    pending_lps[up.index] = []
                    continue
                k = len(b.calls)  # index of the call this event belongs to
                if isinstance(ev, CallStartEvent):
                    head = {"index": k, "id": b.start_call(), "type": "function"}
                    head["function"] = {"name": ev.name, "arguments": ""}
                    yield chunk(up.index, {"tool_calls": [head]})
                    continue
                if isinstance(ev, ArgumentsEvent):
                    args = {"index": k, "function": {"arguments": ev.text}}
                    yield chunk(up.index, {"tool_calls": [args]})
                    continue
                call = b.call(ev)
                if ev.streamed:
                    continue
                head = {"index": k, "id": call.id, "type": "function"}
                head["function"] = {"name": call.function.name, "arguments": ""}
                yield chunk(up.index, {"tool_calls": [head]})
                args = {"index": k, "function": {"arguments": call.function.arguments}}
                yield chunk(up.index, {"tool_calls": [args]})
            if up.finish_reason is not None:
                reason = b.final_reason(up.finish_reason)
                yield chunk(up.index, {}, reason, lps=pending_lps[up.index])
                pending_lps[up.index] = []
    if prep.req.include_usage:
        yield sse(
            {
                "id": gen.request_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [],
                "usage": _usage(gen).model_dump(),
            }
        )


async def create_chat_completion(state: ServerState, request: Request) -> Response:
    arrival = time.monotonic()
    prep = await prepare(state, await read_body(request))
    state.check_alive()
    lease = state.acquire()  # 503 + Retry-After when full
    gen = Generation(
        state,
        new_id("chatcmpl"),
        prep.prompt_token_ids,
        prep.params,
        "chat",
        arrival,
        session=prep.req.session_key,
    )
    return await respond(
        request, lease, prep.headers, prep.req.stream,
        events=lambda: _stream(state, prep, gen), collect=lambda: _collect(state, prep, gen),
        heartbeat_s=state.options.heartbeat_s,
    )  # fmt: skip
