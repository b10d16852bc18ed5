"""Turns a step's logits into next tokens: penalties, logit bias, temperature, top-k/p,
min-p, seeds.

Sampling draws argmax(p / E) with E ~ Exp(1) noise, which picks token i with
probability p_i. A seeded request draws its noise from a generator keyed by
(seed, choice, position), so its tokens do not depend on batch-mates or preemption.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import inf

import torch

from kamado.engine.outputs import TokenLogprob
from kamado.engine.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1


@dataclass
class SampleRow:
    params: SamplingParams
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    index: int  # choice index: siblings of one request draw different noise


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    @torch.inference_mode()
    def __call__(
        self, logits: torch.Tensor, rows: list[SampleRow]
    ) -> tuple[list[int], list[TokenLogprob | None]]:
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in rows):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._adjust_logits(logits, rows)
        tokens = [self._pick(logits[i], row) for i, row in enumerate(rows)]
        logprobs = [
            _logprob_entry(raw_logprobs[i], tokens[i], row.params.logprobs)
            if raw_logprobs is not None and row.params.logprobs is not None
            else None
            for i, row in enumerate(rows)
        ]
        return tokens, logprobs

    def _adjust_logits(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """The rows' penalties and logit biases applied, on a copy where any applies."""
        if not any(r.params.adjusts_logits for r in rows):
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i, row in enumerate(rows):
            p = row.params
            if not p.adjusts_logits:
                continue
            if p.repetition_penalty != 1.0:
                # Hugging Face semantics: every token seen so far, prompt included.
                seen = torch.tensor(sorted(set(row.token_ids)), dtype=torch.long)
                scores = logits[i, seen]
                logits[i, seen] = torch.where(
                    scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
                )
            output = row.token_ids[row.num_prompt_tokens :]
            if output and (p.presence_penalty or p.frequency_penalty):
                # OpenAI semantics: only tokens generated so far.
                counts = torch.bincount(torch.tensor(output), minlength=vocab)[:vocab].float()
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()))
        return logits

    def _pick(self, logits: torch.Tensor, row: SampleRow) -> int:
        if row.params.greedy:
            return int(torch.argmax(logits))
        probs = filtered_probs(logits, row.params)
        noise = torch.empty_like(probs).exponential_(generator=self._generator_for(row))
        return int(torch.argmax(probs / noise))

    def _generator_for(self, row: SampleRow) -> torch.Generator:
        if row.params.seed is None:
            return self.generator
        position = len(row.token_ids) - row.num_prompt_tokens
        key = hash((row.params.seed & _MASK64, row.index, position)) & _MASK64
        return torch.Generator().manual_seed(key)


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a sampled token is drawn from: temperature, top-k, top-p, min-p."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always the top token).
        drop = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if p.min_p > 0.0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _logprob_entry(logprobs: torch.Tensor, token: int, k: int) -> TokenLogprob:
    top: list[tuple[int, float]] = []
    if k > 0:
        values, ids = torch.topk(logprobs, k)
        # Tokens a grammar forbids have no probability (-inf, which JSON cannot carry): the
        # list stops before them, shorter than asked, as OpenAI's may be.
        top = [(i, v) for i, v in zip(ids.tolist(), values.tolist(), strict=True) if v > -inf]
    return TokenLogprob(token_id=token, logprob=float(logprobs[token]), top=top)
