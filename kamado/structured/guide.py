"""Engine side of constrained decoding: one llguidance matcher per constrained sequence.

Each step, the masks of the sequences that sample are computed while the forward pass runs,
then applied to the logits before sampling, a free row allowing every token; the sampled
token then advances each matcher. On a CPU the forward pass holds the engine thread, so the
masks are computed on a worker thread beside it (llguidance and torch both release the
GIL). On a GPU the forward pass is only queued, so the engine thread computes them itself
after queuing it: a second thread gained no overlap there and slowed the step's launches by
contending for the GIL (H200, batch 1, 256 tokens: 0.85-0.88 of the unconstrained rate with
the worker, 0.94-0.97 without). A step with no constrained sequence does none of this.
A preempted sequence recomputes its KV, not its output, so its matcher (keyed by the
sequence) stays where it is.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kamado.structured.bitmask import ALL_ALLOWED, TokenBitmask
from kamado.structured.constraint import Constraint, ConstraintError

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

log = logging.getLogger(__name__)

_GRAMMAR_CACHE_SIZE = 64  # agents resend the same tool schemas every turn


@dataclass
class GuideStats:
    """Where constrained decoding spends time (for `kamado bench --structured`)."""

    masks: int = 0  # token masks computed (one per constrained row per step)
    compute_s: float = 0.0  # mask computation, beside the forward pass
    prepare_s: float = 0.0  # engine thread gathering a step's matchers (on a CPU: for the worker)
    wait_s: float = 0.0  # engine thread waiting for the masks (on a GPU: computing them)
    apply_s: float = 0.0  # masking the logits rows
    advance_s: float = 0.0  # feeding sampled tokens to the matchers


class MaskJob:
    """The masks of one step, being computed beside the forward pass."""

    def __init__(
        self, ready: Callable[[], object], bitmask: TokenBitmask, stats: GuideStats
    ) -> None:
        self._ready = ready  # returns once every row of `bitmask` is written
        self._bitmask = bitmask
        self._stats = stats

    def apply(self, logits: torch.Tensor) -> None:
        """Forbid, in place, every token the grammars do not allow next."""
        started = time.perf_counter()
        self._ready()
        ready = time.perf_counter()
        self._bitmask.apply(logits)
        self._stats.wait_s += ready - started
        self._stats.apply_s += time.perf_counter() - ready


class Guides:
    """Matchers of the engine's constrained sequences, built lazily from the model's tokenizer."""

    def __init__(
        self,
        model: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        hf_tokenizer: Any = None,  # else the model's own (synthetic models have none)
    ) -> None:
        self._model = model
        self._vocab_size = vocab_size
        self._device = device
        self._eos = list(eos_token_ids)
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use (~1 s)
        self._executor: Any = None  # llguidance.LLExecutor
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._bitmask: TokenBitmask | None = None  # built with the tokenizer
        self._fresh: OrderedDict[str, Any] = OrderedDict()  # grammar -> unstarted matcher
        self._matchers: weakref.WeakKeyDictionary[Sequence, Any] = weakref.WeakKeyDictionary()
        self.stats = GuideStats()

    def check(self, constraint: Constraint) -> None:
        """Make sure the constraint can run here; raise ConstraintError saying why not."""
        self._fresh_matcher(constraint.grammar())

    # ---- per step ----------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> MaskJob | None:
        """Start computing the masks of `seqs` (one per logits row); rows of sequences
        without a constraint allow everything, so one masked fill covers the batch."""
        if all(s.params.constraint is None for s in seqs):
            return None
        started = time.perf_counter()
        matchers, free = [], []
        for i, seq in enumerate(seqs):
            if seq.params.constraint is None:
                free.append(i)
            else:
                matchers.append((self._matcher(seq), i))
        assert self._bitmask is not None
        fill = functools.partial(self._fill, matchers, free, len(seqs))
        ready = self._worker.submit(fill).result if self._worker is not None else fill
        self.stats.prepare_s += time.perf_counter() - started
        return MaskJob(ready, self._bitmask, self.stats)

    def advance(self, seq: Sequence, token: int) -> bool:
        """Feed the sampled token; True when the grammar is complete (the sequence stops)."""
        matcher = self._matchers.get(seq)
        if matcher is None:
            return False
        started = time.perf_counter()
        matcher.consume_token(token)
        self.stats.advance_s += time.perf_counter() - started
        if matcher.is_error():
            log.warning("constrained request %s: %s", seq.request_id, matcher.get_error())
            return True
        return matcher.is_stopped()

    # ---- internals ---------------------------------------------------------------------

    def _fill(self, matchers: list[tuple[Any, int]], free: list[int], n_rows: int) -> None:
        """Write the step's rows: each matcher's allowed next tokens, all for the free rows."""
        from llguidance.torch import fill_next_token_bitmask_par

        started = time.perf_counter()
        assert self._bitmask is not None
        bits = self._bitmask.rows(n_rows)
        for i in free:
            bits[i] = ALL_ALLOWED
        fill_next_token_bitmask_par(self._executor, matchers, bits)
        self.stats.masks += len(matchers)
        self.stats.compute_s += time.perf_counter() - started

    def _matcher(self, seq: Sequence) -> Any:
        matcher = self._matchers.get(seq)
        if matcher is None:
            assert seq.params.constraint is not None
            matcher = self._fresh_matcher(seq.params.constraint.grammar())
            # A choice continued after an engine restart brings the tokens it already has.
            for token in seq.token_ids[seq.num_prompt_tokens :]:
                matcher.consume_token(token)
            self._matchers[seq] = matcher
        return matcher

    def _fresh_matcher(self, grammar: str) -> Any:
        cached = self._fresh.get(grammar)
        if cached is None:
            from llguidance import LLMatcher

            cached = LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
            if cached.is_error():
                raise ConstraintError(cached.get_error())
            self._fresh[grammar] = cached
            if len(self._fresh) > _GRAMMAR_CACHE_SIZE:
                self._fresh.popitem(last=False)
        self._fresh.move_to_end(grammar)
        return cached.deep_copy()

    def _llg_tokenizer(self) -> Any:
        if self._tokenizer is None:
            try:
                import llguidance
                import llguidance.hf
            except ModuleNotFoundError:
                raise ConstraintError("structured outputs need the llguidance package") from None
            from kamado.models import load_tokenizer, resolve_model

            hf = self._hf_tokenizer or load_tokenizer(resolve_model(self._model, allow_pull=False))
            if hf is None:
                raise ConstraintError("this model has no tokenizer to constrain outputs with")
            self._tokenizer = llguidance.hf.from_tokenizer(
                hf, n_vocab=self._vocab_size, eos_token=self._eos or None
            )
            # One thread: copies of one compiled grammar share its lexer behind a lock, so
            # more threads only wait (H200, 32 rows: 0.42 ms a step on one thread, 0.48-1.06
            # ms on 12; scripts/mask_speed.py), and they fight torch's OpenMP threads.
            self._executor = llguidance.LLExecutor(1)
            if self._device.type == "cpu":
                self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")
            self._bitmask = TokenBitmask(self._vocab_size, self._device)
        return self._tokenizer
