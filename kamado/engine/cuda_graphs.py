"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step launches hundreds of small kernels; replaying them as one graph keeps the
GPU from waiting on Python between them. Inputs and attention metadata live in static
device buffers that each step overwrites; a batch is padded to the next captured size
(padding rows write no K/V and attend to nothing). Prefill steps stay eager.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kamado.attention.backend import SeqChunk
from kamado.attention.triton_backend import TritonAttention
from kamado.device_copy import copy_into
from kamado.kv.cache import KVCache
from kamado.models.rope import RotaryEmbedding
from kamado.models.transformer import StepContext

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_buckets(max_batch: int) -> list[int]:
    return [b for b in BUCKETS if b < max_batch] + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[..., torch.Tensor],  # (input_ids, positions, StepContext)
        backend: TritonAttention,
        cache: KVCache,
        rope: RotaryEmbedding,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        self.forward, self.backend, self.cache = forward, backend, cache
        self.buckets = batch_buckets(max_batch)
        device = cache.k[0].device
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        max_blocks = -(-max_model_len // cache.block_size)
        self.buffers = backend.decode_buffers(max_batch, max_blocks)
        rope.hold(max_model_len)
        self.rope = rope
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        pool = None
        num_kv_heads = self.cache.k[0].shape[1]
        for batch in reversed(self.buckets):  # largest first: the rest reuse its memory
            ctx = StepContext(
                self.rope, self.backend, self.cache, self.buffers.view(batch, num_kv_heads)
            )
            ids, pos = self.input_ids[:batch], self.positions[:batch]
            # Warm up (Triton compiles, cuBLAS picks kernels) outside the capture.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(ids, pos, ctx)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[batch] = self.forward(ids, pos, ctx)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def fits(self, batch: int) -> bool:
        return batch <= self.buckets[-1]

    def run(
        self, input_ids: list[int] | torch.Tensor, positions: list[int], chunks: list[SeqChunk]
    ) -> torch.Tensor:
        """One decode step of len(chunks) sequences; returns their final hidden states.
        `input_ids` may be on the device already (sampled by the step before)."""
        n = len(chunks)
        batch = next(b for b in self.buckets if b >= n)
        if isinstance(input_ids, torch.Tensor):
            self.input_ids[:n].copy_(input_ids)  # padding rows keep earlier, valid ids
        else:
            ids = torch.zeros(batch, dtype=torch.long)
            ids[:n] = torch.tensor(input_ids)
            copy_into(self.input_ids[:batch], ids)
        pos = torch.zeros(batch, dtype=torch.long)
        pos[:n] = torch.tensor(positions)
        copy_into(self.positions[:batch], pos)
        self.backend.fill_decode_buffers(self.buffers, chunks, self.cache.block_size, batch)
        self.graphs[batch].replay()
        return self.hidden[batch][:n]
