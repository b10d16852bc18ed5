"""Engine side of constrained decoding: one llguidance matcher per constrained sequence.

Each step, the masks of the sequences that sample are computed on a worker thread while
the forward pass runs (llguidance and torch both release the GIL), then applied to their
logits rows before sampling; the sampled token then advances each matcher. A step with no
constrained sequence does none of this. A preempted sequence recomputes its KV, not its
output, so its matcher (keyed by the sequence) stays where it is.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from kamado.structured.constraint import Constraint, ConstraintError

if TYPE_CHECKING:
    from kamado.engine.sequence import Sequence

log = logging.getLogger(__name__)

_GRAMMAR_CACHE_SIZE = 64  # agents resend the same tool schemas every turn


@dataclass
class GuideStats:
    """Where constrained decoding spends time (for `kamado bench --structured`)."""

    masks: int = 0  # token masks computed (one per constrained row per step)
    compute_s: float = 0.0  # mask computation on the worker thread, beside the forward pass
    wait_s: float = 0.0  # engine thread blocked on masks not ready when the logits were
    apply_s: float = 0.0  # masking the logits rows
    advance_s: float = 0.0  # feeding sampled tokens to the matchers


class MaskJob:
    """The masks of one step, being computed beside the forward pass."""

    def __init__(
        self, future: concurrent.futures.Future[torch.Tensor], rows: list[int], stats: GuideStats
    ) -> None:
        self._future = future  # -> allowed tokens as llguidance's bitmask, [len(rows), words]
        self._rows = rows  # the logits rows they belong to
        self._stats = stats

    def apply(self, logits: torch.Tensor) -> None:
        """Forbid, in place, every token the grammars do not allow next. The packed bits
        travel to the logits' device (a GPU unpacks them in microseconds)."""
        started = time.perf_counter()
        bits = self._future.result().to(logits.device, non_blocking=True)
        ready = time.perf_counter()
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1).bool()
        forbidden = ~allowed[:, : logits.shape[-1]]
        if len(self._rows) == logits.shape[0]:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            rows = torch.tensor(self._rows, device=logits.device)
            logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
        self._stats.wait_s += ready - started
        self._stats.apply_s += time.perf_counter() - ready


class Guides:
    """Matchers of the engine's constrained sequences, built lazily from the model's tokenizer."""

    def __init__(
        self,
        model: str,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        hf_tokenizer: Any = None,  # else the model's own (synthetic models have none)
    ) -> None:
        self._model = model
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._hf_tokenizer = hf_tokenizer
        self._tokenizer: Any = None  # llguidance.LLTokenizer, built on first use (~1 s)
        self._executor: Any = None  # llguidance.LLExecutor
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None
        self._fresh: OrderedDict[str, Any] = OrderedDict()  # grammar -> unstarted matcher
        self._matchers: weakref.WeakKeyDictionary[Sequence, Any] = weakref.WeakKeyDictionary()
        self.stats = GuideStats()

    def check(self, constraint: Constraint) -> None:
        """Make sure the constraint can run here; raise ConstraintError saying why not."""
        self._fresh_matcher(constraint.grammar())

    # ---- per step ----------------------------------------------------------------------

    def prepare(self, seqs: list[Sequence]) -> MaskJob | None:
        """Start computing masks for the constrained ones among `seqs` (one per logits row)."""
        rows = [i for i, s in enumerate(seqs) if s.params.constraint is not None]
        if not rows:
            return None
        matchers = [self._matcher(seqs[i]) for i in rows]
        assert self._worker is not None
        return MaskJob(self._worker.submit(self._bitmask, matchers), rows, self.stats)

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

    def _bitmask(self, matchers: list[Any]) -> torch.Tensor:
        """The matchers' allowed next tokens, one packed row each."""
        from llguidance.torch import fill_next_token_bitmask_par

        started = time.perf_counter()
        # Plain memory: llguidance's allocator pins it on CUDA machines, costly every step.
        bits = torch.zeros(len(matchers), (self._vocab_size + 31) // 32, dtype=torch.int32)
        fill_next_token_bitmask_par(self._executor, [(m, i) for i, m in enumerate(matchers)], bits)
        self.stats.masks += len(matchers)
        self.stats.compute_s += time.perf_counter() - started
        return bits

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
            self._executor = llguidance.LLExecutor()
            self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="masks")
        return self._tokenizer
