"""Runs one scheduled step: builds the flat batch, runs the model, samples next tokens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kamado.attention.backend import SeqChunk, make_backend
from kamado.config import EngineConfig, ModelConfig
from kamado.device_copy import to_device
from kamado.engine.layer_clock import LayerClock
from kamado.engine.outputs import TokenLogprob
from kamado.engine.pacer import chunk_sizes
from kamado.engine.sampler import Sampler, SampleRow
from kamado.engine.sampling_params import SamplingParams
from kamado.engine.scheduler import ScheduledSeq
from kamado.engine.sequence import Sequence
from kamado.kv.cache import KVCache
from kamado.kv.quant import KVFormat
from kamado.models.rope import RotaryEmbedding
from kamado.models.row_buckets import rounds_rows, row_buckets
from kamado.models.transformer import (
    ForwardPass,
    LayerState,
    StepContext,
    Transformer,
    join_states,
    split_state,
)
from kamado.structured.guide import Guides

if TYPE_CHECKING:
    from kamado.engine.cuda_graphs import DecodeGraphs

# The CPU warms its matmuls' row buckets up to this many rows at start (0.6-1.0 s for
# qwen2.5-coder-0.5b in bf16 on 2 cores, the head's buckets as much again).
CPU_WARM_ROWS = 512


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
        self.forward: ForwardPass = self.model
        if engine_config.fused_kernels and self.device.type == "cuda":
            from kamado.models.fused_forward import FusedForward

            self.forward = FusedForward(self.model)
        self.sampler = Sampler(engine_config.seed)
        # A CPU computes as the host calls it, so the host's clock can time its layers.
        self.clock = LayerClock() if self.device.type == "cpu" else None
        self.num_staged_splits = 0  # staged chunks split where a layer overran the slack
        self.graphs: DecodeGraphs | None = None
        max_chunk = min(engine_config.max_num_batched_tokens, num_blocks * self.block_size)
        if self.device.type == "cuda":
            self._compile_attention_kernels(model_config, dtype)
            # Before the graphs: chunks longer than the rotary tables (a token budget above
            # the model's positions) grow them, and the graphs then hold them in place.
            self._warm_chunk_shapes(chunk_sizes(max_chunk))
            if engine_config.cuda_graphs:
                self.graphs = self._capture_decode_graphs(engine_config, model_config, num_blocks)
            self._warm_head(chunk_sizes(engine_config.max_num_seqs), dtype)
            torch.cuda.synchronize(self.device)
        elif rounds_rows(self.device, dtype):
            # Every step's matmuls take one of these row counts (row_buckets). Steps of more
            # than CPU_WARM_ROWS are prompt chunks of a second or more, of which a new
            # shape's first call is a few percent: not worth warming at every start.
            self._warm_chunk_shapes(row_buckets(min(max_chunk, CPU_WARM_ROWS)))
            self._warm_head(row_buckets(engine_config.max_num_seqs), dtype)

    def _compile_attention_kernels(self, model_config: ModelConfig, dtype: torch.dtype) -> None:
        from kamado.attention.triton_backend import TritonAttention

        if isinstance(self.backend, TritonAttention):
            self.backend.compile_kernels(self.cache, model_config.num_heads, dtype)

    @torch.inference_mode()
    def _warm_chunk_shapes(self, sizes: list[int]) -> None:
        """Run a chunk of each size through the first layer once: the first matmul of a
        new shape is slow (see chunk_sizes and row_buckets), and would stall the decodes
        beside it. The K/V it writes lands in free blocks, which nothing reads before it
        writes them again."""
        for size in sizes:
            blocks = list(range(-(-size // self.block_size)))
            ctx = self._context([SeqChunk(size, size, blocks)], size)
            state = self.forward.embed(torch.zeros(size, dtype=torch.long, device=self.device))
            positions = torch.arange(size, device=self.device)
            self.forward.run_layers(state, positions, ctx, range(1))

    @torch.inference_mode()
    def _warm_head(self, row_counts: list[int], dtype: torch.dtype) -> None:
        """Compute logits once at each row count. On CUDA the head runs outside the decode
        graphs, and its first call at a new row count picks (cuBLAS) or tunes (the Triton
        GEMVs) its kernel; on the CPU oneDNN makes one. Either would stall the step it fell in."""
        hidden_size = self.model.config.hidden_size
        for rows in row_counts:
            hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=self.device)
            self.forward.logits(hidden)

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

    def execute(self, batch: list[ScheduledSeq], guides: Guides | None = None) -> list[Verified]:
        """Run one forward pass; return the new tokens of each sequence that samples."""
        return self.collect(self.launch(batch, guides))

    @torch.inference_mode()
    def launch(
        self,
        batch: list[ScheduledSeq],
        guides: Guides | None = None,
        feed: Launched | None = None,
    ) -> Launched:
        """Queue one forward pass and what it samples on the device; `collect` reads it.

        A sequence that finishes its prompt while siblings wait to fork from it samples
        one row per sibling from the same logits. Rows of constrained sequences are masked
        by `guides`, whose masks are computed while the model runs. A sequence with draft
        tokens samples a row at each of them as well (see `verify`). An item with `layers`
        is a staged chunk: it runs those layers with the others' rows where their pass is
        eager, in a pass of its own after a CUDA graph's, and samples after their rows once
        its last layer is done.

        With `feed`, every item is the next decode of a sequence in that step, which has
        not been collected yet: its input token is read where `feed` sampled it, on the
        device, and its position is one past the one `feed` computes.
        """
        started = time.perf_counter()
        whole = [item for item in batch if item.layers is None]
        staged = [item for item in batch if item.layers is not None]
        input_ids: list[int] = []
        positions: list[int] = []
        chunks: list[SeqChunk] = []
        rows: list[int] = []
        groups: list[tuple[Sequence, list[int]]] = []  # (sequence, draft): 1 + len(draft) rows
        for item in whole:
            seq = item.seq
            start = seq.num_computed + (1 if feed is not None else 0)
            end = start + item.num_new
            if feed is None:
                input_ids.extend(seq.token_ids[start : end - len(item.draft)])
                input_ids.extend(item.draft)
            positions.extend(range(start, end))
            chunks.append(SeqChunk(item.num_new, end, seq.block_table))
            if item.samples:
                last = len(positions) - 1 - len(item.draft)
                if item.draft:
                    rows.extend(range(last, last + 1 + len(item.draft)))
                    groups.append((seq, item.draft))
                else:
                    for target in (seq, *seq.pending_forks):
                        rows.append(last)
                        groups.append((target, []))
        # Staged chunks that finish their last layer sample after the rows above (unless a
        # layer clock stops them short of it: their masks, the last rows, then go unused).
        finishing = [item for item in staged if item.samples]
        ids = feed.tokens_of([item.seq for item in whole]) if feed is not None else input_ids
        row_seqs = [seq for seq, draft in groups for _ in range(1 + len(draft))]
        row_seqs += [t for item in finishing for t in (item.seq, *item.seq.pending_forks)]
        masks = guides.prepare(row_seqs) if guides is not None else None
        sampled: list[torch.Tensor] = []  # final hidden states of the rows, in group order
        # Beside an eager pass (not a CUDA graph's) a staged chunk joins it for its layers.
        joins = len(staged) == 1 and whole and not self._graph_fits(positions, chunks)
        joining = staged[0] if joins else None
        joined: torch.Tensor | None = None
        if whole:
            hidden, joined = self._run_whole(ids, positions, chunks, joining)
            if rows:
                sampled.append(hidden[self._row_index(rows)])
        for item in staged:
            last = joined if item is joining else self._run_staged(item)
            if item.samples:
                assert last is not None
                targets = (item.seq, *item.seq.pending_forks)
                sampled.extend([last[-1:]] * len(targets))
                groups.extend((t, []) for t in targets)
        # A staged chunk that does not sample leaves the next step's inputs to the decodes.
        one_row_each = len(positions) == len(groups) == len(whole)
        step = Launched(batch, groups, started, one_row_each)
        if not sampled:
            return step
        logits = self.forward.logits(sampled[0] if len(sampled) == 1 else torch.cat(sampled))
        if masks is not None:
            masks.apply(logits)  # where the logits are
        if all(plain_greedy(s.params) for s in row_seqs):
            # Argmax where the logits are: only the token ids cross to the host.
            step.read_tokens(logits.argmax(dim=-1))
        else:
            step.logits = logits
        return step

    def _run_whole(
        self,
        ids: list[int] | torch.Tensor,
        positions: list[int],
        chunks: list[SeqChunk],
        joining: ScheduledSeq | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every layer for the flat batch of `chunks`: from a CUDA graph where one fits (a
        token each), eagerly otherwise. A staged chunk `joining` the pass runs its layers
        with the batch's rows, so their weights are read once. Returns the final hidden
        states of every token, and those of the joining chunk once its last layer is done."""
        if joining is None and self._graph_fits(positions, chunks):
            return self.graphs.run(ids, positions, chunks), None  # type: ignore[union-attr]
        ctx = self._context(chunks, max(positions) + 1)
        ids_t = ids if isinstance(ids, torch.Tensor) else to_device(ids, self.device)
        pos = to_device(positions, self.device)
        if joining is None:
            return self.forward(ids_t, pos, ctx), None
        layers = joining.layers
        assert layers is not None
        staged, staged_pos, staged_chunk = self._staged_input(joining)
        both_ctx = self._context(
            [*chunks, staged_chunk], max(max(positions), staged_chunk.context_len - 1) + 1
        )
        state, late_s = self._run_decodes(self.forward.embed(ids_t), pos, ctx, range(layers.start))
        both, keep = self._run_joined(
            join_states(state, staged), torch.cat([pos, staged_pos]), both_ctx, joining, late_s
        )
        state, staged = split_state(both, len(positions))
        state, _ = self._run_decodes(
            state, pos, ctx, range(joining.layers.stop, self.forward.num_layers)
        )
        joined = self._staged_output(joining, staged)
        if keep < joining.num_new:
            assert joining.seq.staged is not None
            joining.seq.staged.split(keep)
            self.num_staged_splits += 1
        return self.forward.final_norm(state), joined

    def _run_decodes(
        self, state: LayerState, positions: torch.Tensor, ctx: StepContext, layers: range
    ) -> tuple[LayerState, float]:
        """Layers of the decodes alone, beside a joining chunk, and the seconds they took
        past the clock's usual (0 without a clock)."""
        started = time.perf_counter()
        state = self.forward.run_layers(state, positions, ctx, layers)
        if self.clock is None:
            return state, 0.0
        return state, self.clock.decodes_ran(len(layers), time.perf_counter() - started)

    def _run_joined(
        self,
        state: LayerState,
        positions: torch.Tensor,
        ctx: StepContext,
        item: ScheduledSeq,
        late_s: float,
    ) -> tuple[LayerState, int]:
        """A staged chunk's layers joined to the decodes: all of `item.layers`, or where
        the clock measures them, those that fit its slack less what the step already ran
        late (`late_s`). The item then holds the layers that ran. Also returns how many of
        its tokens go on (all, unless its first layer alone took more than the slack and
        layers are left: the chunk is then split, LayerClock.tokens_to_keep)."""
        assert item.layers is not None
        clock, full_slack_s = self.clock, item.slack_s
        if clock is None or full_slack_s is None:
            return self.forward.run_layers(state, positions, ctx, item.layers), item.num_new
        slack_s = full_slack_s - late_s
        keep = item.num_new

        def stops(done: int, layer: int, seconds: float) -> bool:
            nonlocal keep
            if done == 1 and layer + 1 < self.forward.num_layers:
                # Sized for the chunk's later steps, which this one's lateness says
                # nothing about: by the whole slack.
                keep = clock.tokens_to_keep(item.num_new, seconds, full_slack_s)
            return keep < item.num_new or clock.stop_after(done, seconds, slack_s)

        return self._timed_layers(state, positions, ctx, item, stops), keep

    def _timed_layers(
        self,
        state: LayerState,
        positions: torch.Tensor,
        ctx: StepContext,
        item: ScheduledSeq,
        stops: Callable[[int, int, float], bool],
    ) -> LayerState:
        """`item.layers` one at a time, timed by the host's clock: after each, `stops`
        (layers done, that layer, seconds so far) says whether the step ends there; where
        layers are left, the item then holds the layers that ran."""
        layers = item.layers
        assert layers is not None
        started = time.perf_counter()
        for done, layer in enumerate(layers, 1):
            state = self.forward.run_layers(state, positions, ctx, range(layer, layer + 1))
            if stops(done, layer, time.perf_counter() - started) and layer + 1 < layers.stop:
                item.layers, item.completes = range(layers.start, layer + 1), False
                break
        return state

    def _graph_fits(self, positions: list[int], chunks: list[SeqChunk]) -> bool:
        """A CUDA graph can run the batch: a token each, and a captured size fits."""
        return (
            self.graphs is not None
            and len(positions) == len(chunks)
            and self.graphs.fits(len(chunks))
        )

    def _run_staged(self, item: ScheduledSeq) -> torch.Tensor | None:
        """A staged chunk through `item.layers` in a pass of its own (see _staged_output):
        all of them, or where the clock measures them, those that fit `item.slack_s`. The
        item then holds the layers that ran."""
        assert item.layers is not None and item.seq.staged is not None
        state, positions, chunk = self._staged_input(item)
        if item.seq.staged.context is None:
            item.seq.staged.context = self._context([chunk], chunk.context_len)
        ctx, clock, bound_s = item.seq.staged.context, self.clock, item.slack_s
        if clock is None or bound_s is None:
            state = self.forward.run_layers(state, positions, ctx, item.layers)
        else:
            state = self._timed_layers(
                state, positions, ctx, item,
                lambda done, _, seconds: clock.passes_bound(done, seconds, bound_s),
            )  # fmt: skip
        return self._staged_output(item, state)

    def _staged_input(self, item: ScheduledSeq) -> tuple[LayerState, torch.Tensor, SeqChunk]:
        """A staged chunk's residual stream (its embeddings before its first layer), its
        positions, and its place in the KV cache."""
        seq, chunk = item.seq, item.seq.staged
        assert chunk is not None and item.layers is not None
        assert item.layers.start == chunk.next_layer
        start, end = seq.num_computed, seq.num_computed + chunk.num_tokens
        if chunk.state is None:
            ids = to_device(seq.token_ids[start:end], self.device)
            chunk.state = self.forward.embed(ids)
        positions = torch.arange(start, end, device=self.device)
        return chunk.state, positions, SeqChunk(chunk.num_tokens, end, seq.block_table)

    def _staged_output(self, item: ScheduledSeq, state: LayerState) -> torch.Tensor | None:
        """Keep a staged chunk's residual stream for its next layers (its K/V is written
        up to them); return its final hidden states once the last layer is done."""
        chunk = item.seq.staged
        assert chunk is not None and item.layers is not None
        chunk.state, chunk.next_layer = state, item.layers.stop
        return self.forward.final_norm(state) if item.completes else None

    def _context(self, chunks: list[SeqChunk], num_positions: int) -> StepContext:
        self.rope.reserve(num_positions)
        metadata = self.backend.build_metadata(chunks, self.block_size)
        return StepContext(self.rope, self.backend, self.cache, metadata)

    @torch.inference_mode()
    def collect(self, step: Launched) -> list[Verified]:
        """Wait for a launched step's samples (only for that step: one launched after it
        keeps running) and judge each sequence's drafts."""
        if not step.groups:
            return []
        if step.tokens is not None:
            tokens = step.host_tokens()
            logprobs: list[TokenLogprob | None] = [None] * len(tokens)
        else:
            assert step.logits is not None
            sample_rows = [
                SampleRow(seq.params, seq.token_ids + draft[:j], seq.num_prompt_tokens, seq.index)
                for seq, draft in step.groups
                for j in range(1 + len(draft))
            ]
            tokens, logprobs = self.sampler(step.logits.cpu(), sample_rows)
        out, row = [], 0
        for seq, draft in step.groups:
            n = 1 + len(draft)
            out.append(verify(seq, draft, tokens[row : row + n], logprobs[row : row + n]))
            row += n
        return out

    def _row_index(self, rows: list[int]) -> slice | torch.Tensor:
        """Index of the sampled rows in `hidden`, made without waiting for the GPU: the
        forward may still be running, and the logits, masks and argmax queue behind it."""
        first = rows[0]
        if rows == list(range(first, first + len(rows))):  # decodes: every row, in order
            return slice(first, first + len(rows))
        return to_device(rows, self.device)


@dataclass
class Launched:
    """A step whose work is queued on the device. Plain greedy rows keep their argmax
    there (`tokens`, which a step launched next can read as its input) and copy it to the
    host behind the step; other rows keep their logits for the host's sampler."""

    batch: list[ScheduledSeq]
    groups: list[tuple[Sequence, list[int]]]  # (sequence, draft), as the rows are sampled
    started: float  # time.perf_counter() at launch
    # Every sequence through all layers computes one token and samples one row from it,
    # and no staged chunk samples.
    one_row_each: bool
    tokens: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    _host: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    def read_tokens(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens
        if tokens.device.type != "cuda":
            self._host = tokens
            return
        self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        self._host.copy_(tokens, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def host_tokens(self) -> list[int]:
        assert self._host is not None
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()

    @property
    def plain_decode(self) -> bool:
        """One greedy token per decoding sequence, sampled on the device (beside, maybe, a
        staged chunk's layers): a next step can take its decodes' input tokens from
        `tokens` before the host has seen them."""
        return self.tokens is not None and self.one_row_each

    def tokens_of(self, seqs: list[Sequence]) -> torch.Tensor:
        """The tokens this step samples for `seqs` (each one of its rows), on the device."""
        assert self.tokens is not None
        row = {id(seq): i for i, (seq, _) in enumerate(self.groups)}
        index = [row[id(seq)] for seq in seqs]
        if index == list(range(len(self.groups))):
            return self.tokens
        return self.tokens[to_device(index, self.tokens.device)]


@dataclass
class Verified:
    """A sequence's new tokens from one step: the draft tokens the target model agreed
    with, then the target's own token after them."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]
    num_drafted: int

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def verify(
    seq: Sequence, draft: list[int], sampled: list[int], logprobs: list[TokenLogprob | None]
) -> Verified:
    """Keep the longest prefix of `draft` equal to the target's samples at the same rows.

    Row j's token is the target's own sample given the tokens before it, drawn with the
    noise the sampler would use at that position without speculation. Emitting samples
    up to the first disagreement is therefore exactly what decoding one token at a time
    would emit: greedy output is unchanged, seeded output is token-identical, and a
    point-mass draft is accepted with probability p(draft), as in rejection sampling.
    """
    accepted = 0
    while accepted < len(draft) and draft[accepted] == sampled[accepted]:
        accepted += 1
    return Verified(seq, sampled[: accepted + 1], logprobs[: accepted + 1], len(draft))


def plain_greedy(params: SamplingParams) -> bool:
    """The argmax of the (masked, when constrained) logits is the token: no penalties or
    logit bias, and no logprobs to report."""
    return params.greedy and not params.adjusts_logits and params.logprobs is None
