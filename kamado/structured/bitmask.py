"""A step's token masks in llguidance's packed form, and their application to the logits.

llguidance writes one row per logits row, 32 tokens to a 32-bit word (bit set: allowed).
The rows live in one host buffer kept across steps: allocating it each step ran a torch
fill on every CPU thread at batch 8 and up, and OpenMP's threads then spin for
milliseconds after it, starving the mask threads (scripts/mask_speed.py shows it). On a
GPU the buffer is pinned, so its copy is asynchronous, and the bits are unpacked there.

The buffer is rewritten only after the step that copied it has read its sampled tokens back
(the engine's one synchronization a step), so the copy has finished by then without an
event of its own (recording one cost 0.05 ms a step on the H200's host).
"""

from __future__ import annotations

import torch

ALL_ALLOWED = -1  # every bit set: the row of a sequence without a constraint


class TokenBitmask:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.words = (vocab_size + 31) // 32
        self._device = device
        self._host = torch.empty(0, self.words, dtype=torch.int32)
        # The value of each bit of a word (bit 31 as int32), to unpack a row with one AND.
        bit_values = [1 << i for i in range(31)] + [-(1 << 31)]
        self._bit_values = torch.tensor(bit_values, dtype=torch.int32, device=device)

    def rows(self, n: int) -> torch.Tensor:
        """The buffer's first `n` rows, for matchers to write into (grown when short)."""
        if self._host.shape[0] < n:
            pin = self._device.type == "cuda"
            rows = max(n, 2 * self._host.shape[0])
            self._host = torch.empty(rows, self.words, dtype=torch.int32, pin_memory=pin)
        return self._host[:n]

    def apply(self, logits: torch.Tensor) -> None:
        """Set to -inf, in place, every logit whose bit in the first rows is clear."""
        n, vocab = logits.shape
        bits = self._host[:n].to(logits.device, non_blocking=True)
        allowed = (bits.unsqueeze(-1) & self._bit_values).view(n, -1)[:, :vocab]
        logits.masked_fill_(allowed == 0, float("-inf"))
