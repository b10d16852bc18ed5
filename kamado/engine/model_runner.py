"""Runs one scheduled step: builds the flat batch, runs the model, samples next tokens."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kamado.attention.backend import SeqChunk, make_backend
from kamado.config import EngineConfig, ModelConfig
from kamado.engine.outputs import TokenLogprob
from kamado.engine.sampler import Sampler, SampleRow
from kamado.engine.sampling_params import SamplingParams
from kamado.engine.scheduler import ScheduledSeq
from kamado.engine.sequence import Sequence
from kamado.kv.cache import KVCache
from kamado.kv.quant import KVFormat
from kamado.models.rope import RotaryEmbedding
from kamado.models.transformer import StepContext, Transformer
from kamado.structured.guide import Guides

if TYPE_CHECKING:
    from kamado.engine.cuda_graphs import DecodeGraphs


class ModelRunner:
    def __init__(
        self,
        engine_config: EngineConfig,
        model_config: ModelConfig,
        model: Transformer,  # loaded, surgery applied
        dtype: torch.dtype,
        num_blocks: int,
        kv_format: KVFormat | None = None,
    ) -> None:
        self.device = torch.device(engine_config.device)
        self.block_size = engine_config.block_size
        self.model = model
        self.cache = KVCache(
            model_config, num_blocks, self.block_size, dtype, self.device, kv_format
        )
        self.backend = make_backend(
            engine_config.attention_backend, self.device, model_config.sliding_window
        )
        self.rope = RotaryEmbedding(model_config, self.device)
        self.forward: Callable[..., torch.Tensor] = self.model
        if engine_config.fused_kernels and self.device.type == "cuda":
            from kamado.models.fused_forward import FusedForward

            self.forward = FusedForward(self.model)
        self.sampler = Sampler(engine_config.seed)
        self.graphs: DecodeGraphs | None = None
        if engine_config.cuda_graphs and self.device.type == "cuda":
            self.graphs = self._capture_decode_graphs(engine_config, model_config, num_blocks)

    def _capture_decode_graphs(
        self, engine_config: EngineConfig, model_config: ModelConfig, num_blocks: int
    ) -> DecodeGraphs | None:
        from kamado.attention.triton_backend import TritonAttention
        from kamado.engine.cuda_graphs import DecodeGraphs

        if not isinstance(self.backend, TritonAttention):
            return None
        max_len = min(
            engine_config.max_model_len or model_config.max_position_embeddings,
            num_blocks * self.block_size,
        )
        return DecodeGraphs(
            self.forward, self.backend, self.cache, self.rope, engine_config.max_num_seqs, max_len
        )

    @torch.inference_mode()
    def execute(
        self, batch: list[ScheduledSeq], guides: Guides | None = None
    ) -> list[tuple[Sequence, int, TokenLogprob | None]]:
        """Run one forward pass; return (sequence, next token, logprob) for each sampled row.

        A sequence that finishes its prompt while siblings wait to fork from it samples
        one row per sibling from the same logits. Rows of constrained sequences are masked
        by `guides`, whose masks are computed while the model runs.
        """
        input_ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        sampled: list[Sequence] = []
        for item in batch:
            seq, start = item.seq, item.seq.num_computed
            end = start + item.num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            chunks.append(SeqChunk(item.num_new, end, seq.block_table))
            if item.samples:
                for target in (seq, *seq.pending_forks):
                    rows.append(len(input_ids) - 1)
                    sampled.append(target)
        masks = guides.prepare(sampled) if guides is not None else None
        if (
            self.graphs is not None
            and len(input_ids) == len(chunks)
            and self.graphs.fits(len(chunks))
        ):
            hidden = self.graphs.run(input_ids, positions, chunks)
        else:
            self.rope.reserve(max(positions) + 1)
            metadata = self.backend.build_metadata(chunks, self.block_size)
            ctx = StepContext(self.rope, self.backend, self.cache, metadata)
            hidden = self.forward(
                torch.tensor(input_ids, device=self.device),
                torch.tensor(positions, device=self.device),
                ctx,
            )
        if not rows:
            return []
        logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)])
        if masks is not None:
            masks.apply(logits)  # where the logits are
        if all(plain_greedy(s.params) for s in sampled):
            # Argmax where the logits are: only the token ids cross to the host.
            tokens = logits.argmax(dim=-1).tolist()
            return [(s, t, None) for s, t in zip(sampled, tokens, strict=True)]
        logits = logits.cpu()
        sample_rows = [
            SampleRow(s.params, s.token_ids, s.num_prompt_tokens, s.index) for s in sampled
        ]
        tokens, logprobs = self.sampler(logits, sample_rows)
        return list(zip(sampled, tokens, logprobs, strict=True))


def plain_greedy(params: SamplingParams) -> bool:
    """The argmax of the (masked, when constrained) logits is the token: no penalties and no
    logprobs to report."""
    return params.greedy and not params.penalized and params.logprobs is None
