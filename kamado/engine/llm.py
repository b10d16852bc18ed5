"""The offline Python API: `LLM(model).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
from typing import Any

from kamado.config import DEFAULT_MODEL, EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.detokenizer import TextStream
from kamado.engine.outputs import CompletionOutput, RequestOutput
from kamado.engine.sampling_params import SamplingParams
from kamado.models import load_tokenizer, resolve_model


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, **engine_options: Any) -> None:
        self.config = EngineConfig(model=model, **engine_options)
        self.engine = EngineCore(self.config)
        self.tokenizer = load_tokenizer(resolve_model(model))
        self._ids = itertools.count()

    def generate(
        self,
        prompts: str | list[str] | list[list[int]],
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts (text, or token id lists) to completion; results keep prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(params, list):
            params = [params or SamplingParams()] * len(prompts)
        results: dict[str, RequestOutput] = {}
        streams: dict[tuple[str, int], TextStream] = {}
        for prompt, p in zip(prompts, params, strict=True):
            ids = self._encode(prompt)
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, ids, p)
            results[request_id] = RequestOutput(
                request_id,
                ids,
                [
                    CompletionOutput(i, "", [], None, [] if p.logprobs is not None else None)
                    for i in range(p.n)
                ],
            )
            if self.tokenizer is not None:
                for i in range(p.n):
                    streams[request_id, i] = TextStream(self.tokenizer, p, ids)
        while self.engine.has_work():
            for delta in self.engine.step():
                result = results[delta.request_id]
                result.num_cached_tokens = max(result.num_cached_tokens, delta.num_cached_tokens)
                out = result.outputs[delta.index]
                out.finish_reason = delta.finish_reason
                stream = streams.get((delta.request_id, delta.index))
                new = delta.new_token_ids
                if stream is not None:
                    out.text += stream.add(new)
                    new = new[: stream.num_used]  # not the tokens after a stop string
                out.token_ids.extend(new)
                if delta.logprobs is not None and out.logprobs is not None:
                    out.logprobs.extend(delta.logprobs[: len(new)])
                if stream is None:
                    continue
                if stream.stopped and delta.finish_reason is None:
                    self.engine.abort(delta.request_id, delta.index)
                    out.finish_reason = "stop"
                if out.finish_reason is not None:
                    out.text += stream.flush()
        return list(results.values())

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token id lists")
            return self.tokenizer.encode(prompt)
        return list(prompt)
