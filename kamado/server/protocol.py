"""OpenAI wire format: request models (lenient: unknown fields are accepted) and responses."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    # Clients send fields we do not know (user, metadata, store, ...); accept and ignore them.
    model_config = ConfigDict(extra="allow")


# ---- requests ---------------------------------------------------------------------------


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class FunctionCall(_Lenient):
    name: str
    # OpenAI sends a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = ""


class ToolCall(_Lenient):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # A reasoning model's earlier thinking, sent back by clients that keep it (Qwen3
    # templates render it, e.g. with preserve_thinking).
    reasoning_content: str | None = None


class FunctionDefinition(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(_Lenient):
    include_usage: bool | None = False


class _SamplingFields(_Lenient):
    """Fields shared by /v1/completions and /v1/chat/completions (None = default)."""

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # Extra body fields (vLLM-style) for the engine's other samplers.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    # The agent session a request belongs to, for the prefix cache's eviction order.
    prompt_cache_key: str | None = None
    user: str | None = None
    # Extra body fields constraining the reply: a regular expression, or a Lark grammar.
    guided_regex: str | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def session_key(self) -> str | None:
        return self.prompt_cache_key or self.user or None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    # Variables for the chat template (vLLM's name), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    # OpenAI's legacy form: the number of top logprobs per token (0..5; we allow 20).
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


# ---- responses --------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kamado"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
