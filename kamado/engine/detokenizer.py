"""Token ids to text, incrementally: correct across multi-byte characters, with stop strings.

Text is released only when final: an incomplete UTF-8 sequence (decoded as U+FFFD) waits
for its next token, and a tail that could still grow into a stop string is held back.
"""

from __future__ import annotations

from typing import Any

from kamado.engine.sampling_params import SamplingParams

# Prompt tokens decoded as context, so the first output token gets its leading space right.
_CONTEXT_TOKENS = 4


class TextStream:
    def __init__(
        self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stops = params.stop
        context = list(prompt_token_ids or [])[-_CONTEXT_TOKENS:]
        self._ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""  # output text so far (cut before a matched stop string)
        self._released = 0  # characters of self.text handed out
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched
        self.num_used = 0  # tokens of the last add() that belong to the output

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the text that became final. `num_used` says how
        many of them belong to the output: with speculation a step brings several tokens,
        and those after the one that completed a stop string are dropped."""
        self.num_used = 0
        if self.stopped:
            return ""
        for token in token_ids:
            self._ids.append(token)
            self.text += self._decode_new()
            self.num_used += 1
            if self.stops:
                self._match_stops()
                if self.stopped:
                    break
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        return self._release(end)

    def flush(self) -> str:
        """At the end of generation: whatever was held back is final now."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out = self.text[self._released : end]
        self._released = max(self._released, end)
        return out

    def _decode_new(self) -> str:
        def decode(ids: list[int]) -> str:
            return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

        prefix = decode(self._ids[self._prefix_offset : self._read_offset])
        full = decode(self._ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return full[len(prefix) :]
        return ""

    def _match_stops(self) -> None:
        longest = max(len(s) for s in self.stops)
        window_start = max(0, self._released - longest + 1)
        hits = [
            (pos, stop) for stop in self.stops if (pos := self.text.find(stop, window_start)) != -1
        ]
        if hits:
            pos, stop = min(hits)
            self.text = self.text[:pos]
            self.stopped = True
            self.stop_reason = stop

    def _held_back(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        best = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(self.text)), best, -1):
                if self.text.endswith(stop[:n]):
                    best = n
                    break
        return best
