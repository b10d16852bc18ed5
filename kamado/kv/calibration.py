"""Static KV scales (`--kv-cache-dtype fp8-static`, kv/quant.py): the largest |K| and |V|
per layer and kv head over one prefill of a fixed calibration text, with headroom, as
powers of two.

The text is a coding agent's turn (a system prompt, a file, a tool call and its output)
through the model's chat template, so the special tokens and code that agents send are in
it. Headroom: the largest value of other prompts may pass the calibration's (the fixed
prompts of kamado/bench/kv_cache.py reached 1.27x it on smollm2-135m and 1.37x on
qwen2.5-coder-0.5b, `scripts/kv_fp8_scales.py`); with 4x, rounded up to a power of two,
the calibration's largest value sits at 56-112 of e4m3's 448. Past the range, values are
clamped. Powers of two: codes times scale is exact, and the same model calibrated on
another device, whose sums round a little differently, mostly lands on the same scales.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from kamado.attention.backend import make_backend
from kamado.config import ModelConfig
from kamado.kv.quant import MIN_SCALE, KVFormat
from kamado.models.errors import ModelLoadError
from kamado.models.prefill import prefill_alone
from kamado.models.rope import RotaryEmbedding
from kamado.models.source import ModelSource
from kamado.models.tokenizer import load_tokenizer
from kamado.models.transformer import ForwardPass

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

CALIBRATION_TOKENS = 512
HEADROOM = 4.0
CALIBRATION_BLOCK = 16

CALIBRATION_SYSTEM = (
    "You are a coding agent working in a Git repository. Read files before changing them, "
    "keep changes small, and run the tests after each edit. Answer with a tool call when "
    "you need to act."
)
# Written for kamado: code, a tool call and its output, and prose, as agents send them.
CALIBRATION_USER = '''The scheduler drops requests under load. Here is kamado/queue.py:

```python
from collections import deque
from dataclasses import dataclass, field


@dataclass
class Request:
    request_id: str
    prompt_tokens: list[int]
    max_tokens: int = 256
    priority: int = 0
    arrived_at: float = field(default=0.0)


class RequestQueue:
    """Waiting requests, oldest first within a priority."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._waiting: dict[int, deque[Request]] = {}

    def push(self, request: Request) -> bool:
        if len(self) >= self.capacity:
            return False
        self._waiting.setdefault(request.priority, deque()).append(request)
        return True

    def pop(self) -> Request | None:
        for priority in sorted(self._waiting, reverse=True):
            if self._waiting[priority]:
                return self._waiting[priority].popleft()
        return None

    def __len__(self) -> int:
        return sum(len(q) for q in self._waiting.values())
```

I ran {"name": "run_tests", "arguments": {"path": "tests/test_queue.py", "verbose": true}}
and got:

    FAILED tests/test_queue.py::test_full_queue_rejects_with_429 - assert 200 == 429
    1 failed, 14 passed in 0.83s

The HTTP layer ignores push() returning False, so a full queue answers 200 with an empty
body. Fix it so that the client gets a 429 with a Retry-After header, and add a test.
SELECT status, COUNT(*) FROM requests WHERE created_at > now() - interval '1 hour' GROUP BY 1;
'''


def calibration_ids(source: ModelSource, vocab_size: int) -> list[int]:
    """The calibration text as the model's tokens (through its chat template where it has
    one); random token ids where there is no tokenizer to encode it (synthetic weights, or
    a model given without one: the engine itself runs on token ids)."""
    try:
        tokenizer = load_tokenizer(source)
    except ModelLoadError as e:
        log.info("calibrating the KV scales on random tokens: %s", e)
        tokenizer = None
    ids = [] if tokenizer is None else _encode(tokenizer)
    if len(ids) < CALIBRATION_TOKENS // 4:  # also a toy vocabulary that encodes little
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(vocab_size, (CALIBRATION_TOKENS,), generator=generator).tolist()
    return ids[:CALIBRATION_TOKENS]


def _encode(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    both = CALIBRATION_SYSTEM + "\n\n" + CALIBRATION_USER
    if getattr(tokenizer, "chat_template", None):
        # Some templates refuse a system turn (Mistral's, Gemma's): then one user turn.
        for messages in (
            [
                {"role": "system", "content": CALIBRATION_SYSTEM},
                {"role": "user", "content": CALIBRATION_USER},
            ],
            [{"role": "user", "content": both}],
        ):
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False)
            except Exception:  # jinja's raise_exception and type errors alike
                continue
            return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(both)


@torch.no_grad()  # not inference mode: the scales outlive it, in every later step
def calibrated(
    fmt: KVFormat,
    model: ForwardPass,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    ids: list[int],
) -> KVFormat:
    """`fmt` (a static format) with its scales: [2 (K, V), layers, kv_heads] float32, from
    the K/V the model computes over `ids` (stored in the model's dtype)."""
    assert fmt.static and fmt.qmax is not None
    device = torch.device(device)
    backend = make_backend("torch", device, config.sliding_window)
    rope = RotaryEmbedding(config, device)
    _, cache = prefill_alone(model, rope, backend, ids, config, dtype, device, CALIBRATION_BLOCK)
    amax = torch.stack(
        [
            torch.stack([t[: len(ids)].float().abs().amax(dim=(0, 2)) for t in ts])
            for ts in (cache.k, cache.v)
        ]
    )
    return dataclasses.replace(fmt, scales=static_scales(amax, fmt.qmax).cpu())


def static_scales(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Scales for values up to `amax` (any shape): HEADROOM times it at the largest code
    `qmax`, rounded up to a power of two."""
    return torch.exp2(torch.ceil(torch.log2(amax * HEADROOM / qmax))).clamp_min(MIN_SCALE)
