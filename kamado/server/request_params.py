"""Request fields -> SamplingParams, and fitting max_tokens into the context (CLIENTS.md 12)."""

from __future__ import annotations

from dataclasses import dataclass

from kamado.engine.sampling_params import SamplingParams
from kamado.server.errors import APIError
from kamado.server.protocol import _SamplingFields
from kamado.structured import Constraint


@dataclass
class TokenBudget:
    max_tokens: int
    clamped_from: int | None  # the requested value, when it did not fit


def fit_max_tokens(
    prompt_len: int, max_model_len: int, requested: int | None, default: int | None
) -> TokenBudget:
    """Clamp max_tokens to the room left after the prompt; refuse only a prompt that fills it."""
    if requested is not None and requested < 1:
        raise APIError(
            f"max_tokens must be at least 1 (got {requested}).",
            param="max_tokens",
            code="invalid_value",
        )
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            f"The prompt is {prompt_len} tokens, but this server's context window "
            f"(max_model_len) is {max_model_len} tokens, leaving no room for a reply; "
            "shorten the prompt or start the server with a larger --max-model-len.",
            param="messages",
            code="context_length_exceeded",
        )
    want = requested if requested is not None else default
    if want is None:
        return TokenBudget(room, None)
    if want > room:
        return TokenBudget(room, requested)
    return TokenBudget(want, None)


def sampling_params(
    req: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    stop_token_ids: list[int],
    vocab_size: int | None,
    constraint: Constraint | None = None,
) -> SamplingParams:
    stop = req.stop if req.stop is not None else []
    try:
        return SamplingParams(
            n=1 if req.n is None else req.n,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k is None else req.top_k,
            min_p=0.0 if req.min_p is None else req.min_p,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            seed=req.seed,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=[] if req.ignore_eos else stop_token_ids,
            ignore_eos=bool(req.ignore_eos),
            logprobs=logprobs,
            constraint=constraint,
            logit_bias=_logit_bias(req.logit_bias, vocab_size),
        )
    except ValueError as e:
        message = str(e)
        raise APIError(
            f"Invalid parameter: {message}.", param=message.split(" ", 1)[0], code="invalid_value"
        ) from None


def _logit_bias(raw: dict[str, float] | None, vocab_size: int | None) -> dict[int, float]:
    """OpenAI's logit_bias, keyed by token ids written as strings, as token ids; the values'
    range is SamplingParams' to check."""
    bias: dict[int, float] = {}
    for key, value in (raw or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            raise APIError(
                f"logit_bias keys must be token ids in [0, {vocab_size}); got {key!r}.",
                param="logit_bias",
                code="invalid_value",
            )
        bias[token] = value
    return bias
