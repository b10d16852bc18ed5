"""The engine core: requests in, token deltas out, one synchronous step at a time.

It knows nothing of HTTP or text: prompts arrive as token ids and stop strings are the
caller's business (it aborts a request once its text matched one).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import torch

from kamado.config import EngineConfig, ModelConfig
from kamado.engine.cpu_threads import DEFAULT_THREADS, ThreadGovernor
from kamado.engine.model_loading import host_tier_bytes, kv_fingerprint, load_for_engine
from kamado.engine.model_runner import Launched, ModelRunner, Verified
from kamado.engine.outputs import TokenDelta
from kamado.engine.pacer import PrefillPacer
from kamado.engine.sampling_params import SamplingParams
from kamado.engine.scheduler import ScheduledSeq, Scheduler
from kamado.engine.sequence import Sequence, Status
from kamado.engine.step_collector import StepCollector
from kamado.kv.block_pool import BlockPool
from kamado.kv.disk_tier import DiskTier
from kamado.kv.host_tier import HostTier
from kamado.kv.prefix_cache import PrefixCache
from kamado.kv.tier_transfers import TierTransfers
from kamado.spec.speculator import make_speculator
from kamado.structured.constraint import ConstraintError
from kamado.structured.guide import Guides
from kamado.surgery.kv import with_kv_surgery

log = logging.getLogger(__name__)

RESTORE_POLL_SECONDS = 0.005  # an engine waiting only on restores checks this often


class RequestError(ValueError):
    """A request the engine cannot serve as given; the message says what to change."""


@dataclass
class EngineStats:
    num_waiting: int = 0
    num_running: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    staged_splits: int = 0  # staged chunks split where a layer overran (CPU pacing)
    steps: int = 0
    last_step_seconds: float = 0.0  # the forward pass: from its launch to its tokens read
    # The host's part of the last step around it: scheduling and launching before it (0
    # for a step launched ahead, during the step before), committing and appending after.
    last_step_schedule_seconds: float = 0.0
    last_step_finish_seconds: float = 0.0
    # What the last step carried: decoding sequences, prompt tokens, draft tokens verified.
    last_step_decodes: int = 0
    last_step_prefill_tokens: int = 0
    last_step_draft_tokens: int = 0
    last_step_prefill_layers: int = 0  # of a chunk going a few layers a step; 0: none
    # Decode steps queued before the previous step's tokens were read (overlap_decode).
    steps_launched_ahead: int = 0
    last_step_launched_ahead: bool = False  # queued before the step before it was read
    # Prefix cache: prompt tokens looked up, and those found on the device, in host RAM or
    # on disk.
    prefix_queried_tokens: int = 0
    prefix_device_hit_tokens: int = 0
    prefix_partial_hit_tokens: int = 0  # of the device hits, those copied from inside a block
    prefix_host_hit_tokens: int = 0
    prefix_disk_hit_tokens: int = 0
    kv_blocks_cached: int = 0  # unreferenced blocks kept for reuse
    kv_evictions: int = 0  # cached device blocks overwritten
    host_blocks: int = 0  # blocks in the host-RAM tier
    host_evictions: int = 0  # host blocks pushed out for newer ones (kept on disk)
    host_bypassed: int = 0  # evicted device blocks written straight to disk (no free slot)
    # Bytes moved between tiers, by (source, destination).
    tier_bytes: dict[tuple[str, str], int] = field(default_factory=dict)
    disk_bytes: int = 0  # size of the disk tier's directory
    disk_files_corrupt: int = 0  # unreadable or mismatched files found (and removed)
    disk_files_removed: int = 0  # files deleted to stay under the size cap
    history_rewrites: int = 0  # turns whose prompt rewrote the session's previous prompt
    history_rewritten_tokens: int = 0  # tokens of history recomputed because of it
    resident_memory_bytes: int = 0  # the engine process's RSS (0 where it cannot be read)
    cpu_threads: int = 0  # threads the model computes with now (0 on an accelerator)
    # Speculation, per proposer: tokens drafted, drafted tokens accepted, drafts verified.
    spec_drafted_tokens: dict[str, int] = field(default_factory=dict)
    spec_accepted_tokens: dict[str, int] = field(default_factory=dict)
    spec_verified_drafts: dict[str, int] = field(default_factory=dict)


@dataclass
class StepWork:
    """What a step carried, as the pacer and the stats count it."""

    num_decodes: int
    num_drafted: int
    prefill_tokens: int  # prompt tokens through every layer
    staged: list[tuple[int, int]]  # (tokens, layers) of chunks through some of the layers
    staged_tokens_done: int  # tokens of staged chunks whose last layer ran

    @classmethod
    def of(cls, batch: list[ScheduledSeq]) -> StepWork:
        whole = [item for item in batch if item.layers is None]
        staged = [item for item in batch if item.layers is not None]
        # A decode feeds an output token; a prompt's last token alone (its chunk of one, at
        # the end of a prompt) also samples, and is prompt work.
        num_decodes = sum(
            1
            for item in whole
            if item.samples and item.num_new - len(item.draft) == 1 and item.seq.num_output_tokens
        )
        num_drafted = sum(len(item.draft) for item in whole)
        return cls(
            num_decodes,
            num_drafted,
            sum(item.num_new for item in whole) - num_decodes - num_drafted,
            [(item.num_new, len(item.layers)) for item in staged if item.layers is not None],
            sum(item.num_new for item in staged if item.completes),
        )


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config = with_kv_surgery(config)
        self.threads = (
            ThreadGovernor(DEFAULT_THREADS, config.cpu_threads)
            if torch.device(config.device).type == "cpu"
            else None
        )
        loaded = load_for_engine(config)
        self.model_config: ModelConfig = loaded.model_config
        self.dtype = loaded.dtype
        self.kv_format = loaded.kv_format
        self.num_blocks = loaded.num_blocks
        self.max_model_len = loaded.max_model_len
        self.surgery = loaded.surgery
        self.runner = ModelRunner(
            config, self.model_config, loaded.model, self.dtype, self.num_blocks, self.kv_format
        )
        del loaded
        self.pool = BlockPool(self.num_blocks)
        self.disk = self._disk_tier() if config.enable_prefix_caching else None
        self.host = self._host_tier() if config.enable_prefix_caching else None
        self.transfers = (
            TierTransfers(self.runner.cache, self.host, self.disk)
            if self.host is not None or self.disk is not None
            else None
        )
        self.prefix = PrefixCache(
            self.pool,
            config.block_size,
            self.transfers,
            enabled=config.enable_prefix_caching,
            cache=self.runner.cache,
        )
        self.pacer = PrefillPacer(
            config.decode_stall_factor,
            config.max_num_batched_tokens,
            config.short_turn_stall_factor,
            self.model_config.num_layers,
        )
        self.speculator = make_speculator(config, self.max_model_len, self.model_config.vocab_size)
        self.scheduler = Scheduler(
            self.pool,
            self.prefix,
            config.block_size,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.pacer,
            self.model_config.num_layers,
            self.speculator,
            config.alone_step_s if self.runner.clock is not None else None,
        )
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        self.guides = Guides(
            config.model,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            self.runner.device,
        )
        self._requests: dict[str, list[Sequence]] = {}
        self._arrivals = 0
        self.overlap = (
            config.overlap_decode
            if config.overlap_decode is not None
            else self.runner.device.type == "cuda"
        )
        self._in_flight: Launched | None = None  # a decode step launched ahead, not read yet
        self._last_collected = 0.0
        self.stats = EngineStats(kv_blocks_total=self.num_blocks)
        # Last: it freezes everything alive now, out of the collector's scans.
        self.collector = StepCollector(enabled=self.runner.device.type == "cuda")

    def _disk_tier(self) -> DiskTier | None:
        c = self.config
        if not c.kv_disk_dir or c.kv_disk_bytes <= 0:
            return None
        fingerprint = kv_fingerprint(c, self.model_config, self.dtype, self.kv_format)
        return DiskTier(c.kv_disk_dir, c.kv_disk_bytes, fingerprint, self.runner.cache.block_bytes)

    def _host_tier(self) -> HostTier | None:
        capacity = host_tier_bytes(self.config)
        block_bytes = self.runner.cache.block_bytes
        if capacity < block_bytes:
            return None
        pin = torch.device(self.config.device).type == "cuda"
        return HostTier(capacity, block_bytes, pin, self.disk)

    def close(self) -> None:
        """Finish writing what the disk tier was given (a clean shutdown)."""
        if self.disk is not None:
            self.disk.flush()

    # ---- requests -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        session: str | None = None,
        continue_from: dict[int, list[int]] | None = None,
    ) -> None:
        """Queue a request. `session` names the agent session it belongs to, so the prefix
        cache keeps that session's newest turn over the branches it superseded.
        `continue_from` maps choices of a request begun on an engine that was lost to the
        tokens they had generated: only those choices run, each from there."""
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already running")
        self._check_prompt(prompt_token_ids)
        self._check_token_ids(list(params.logit_bias), "logit_bias token ids")
        if params.constraint is not None:
            try:
                self.guides.check(params.constraint)
            except ConstraintError as e:
                raise RequestError(f"the output constraint cannot be used: {e}") from None
        if continue_from is not None:
            self._check_continuation(prompt_token_ids, params, continue_from)
            seqs = [
                self._new_sequence(request_id, index, prompt_token_ids, params, session, outputs)
                for index, outputs in sorted(continue_from.items())
            ]
            for seq in seqs:
                self.scheduler.add(seq)
        else:
            seqs = [
                self._new_sequence(request_id, index, prompt_token_ids, params, session, [])
                for index in range(params.n)
            ]
            # Choice 0 prefills the prompt once; the others fork from it (sharing its KV).
            seqs[0].pending_forks = seqs[1:]
            self.scheduler.add(seqs[0])
        self._requests[request_id] = seqs

    def _new_sequence(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        session: str | None,
        outputs: list[int],
    ) -> Sequence:
        self._arrivals += 1
        seq = Sequence(request_id, index, list(prompt), params, self._arrivals)
        seq.session = session
        seq.token_ids.extend(outputs)
        return seq

    def _check_continuation(
        self, prompt: list[int], params: SamplingParams, continue_from: dict[int, list[int]]
    ) -> None:
        for index, outputs in continue_from.items():
            if not 0 <= index < params.n:
                raise RequestError(f"choice {index} does not exist (n={params.n})")
            self._check_token_ids(outputs, "token ids")
            if params.max_tokens is not None and len(outputs) >= params.max_tokens:
                raise RequestError(f"choice {index} already has max_tokens tokens")
            if len(prompt) + len(outputs) >= self.max_model_len:
                raise RequestError(f"choice {index} already fills the context")

    def _check_token_ids(self, ids: list[int], what: str) -> None:
        # min and max loop in C: over a 131k-token prompt 4.1 ms against 7.1 ms for a
        # generator (this 2-core CPU), in the engine loop, a stall for every stream beside.
        vocab = self.model_config.vocab_size
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            raise RequestError(f"{what} must be in [0, {vocab})")

    def _check_prompt(self, prompt: list[int]) -> None:
        if not prompt:
            raise RequestError("the prompt is empty")
        self._check_token_ids(prompt, "prompt token ids")
        if len(prompt) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(prompt)} tokens; this model's context is "
                f"{self.max_model_len} tokens, prompt and output together"
            )

    def abort(self, request_id: str, index: int | None = None) -> None:
        """Stop a request (or one of its choices, e.g. when its text hit a stop string)."""
        seqs = self._requests.get(request_id, [])
        for seq in seqs:
            if (index is None or seq.index == index) and seq.status is not Status.FINISHED:
                self.scheduler.finish(seq, "abort")
                if seq.index == 0:
                    # Siblings still waiting to fork from choice 0 start on their own.
                    for child in seq.pending_forks:
                        self.scheduler.add(child)
                    seq.pending_forks = []
        self.scheduler.release_finished()  # an abort gives its blocks back at once
        self._forget_if_done(request_id)

    def _forget_if_done(self, request_id: str) -> None:
        seqs = self._requests.get(request_id, [])
        if all(s.status is Status.FINISHED for s in seqs):
            self._requests.pop(request_id, None)

    def has_work(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_work()

    # ---- the step ---------------------------------------------------------------------

    def step(self) -> list[TokenDelta]:
        with self.collector.holding():
            return self._step()

    def _step(self) -> list[TokenDelta]:
        scheduling = time.perf_counter()
        launched, self._in_flight = self._in_flight, None
        self.stats.last_step_launched_ahead = launched is not None
        if launched is None:
            batch = self.scheduler.schedule()
            if not batch:
                self.scheduler.release_finished()
                if self.transfers is not None:
                    self.transfers.wait_any(RESTORE_POLL_SECONDS)  # only restores are left
                return []
            if self.transfers is not None:
                self.transfers.save_evicted()  # before this step overwrites the evicted blocks
            if self.threads is not None:
                self.threads.update()
            launched = self.runner.launch(batch, self.guides)
        if self.overlap:
            self._in_flight = self._launch_ahead(launched)
        # While the device computes (see Scheduler.finish).
        self.scheduler.release_finished()
        self.collector.collect_due()
        verified = self.runner.collect(launched)
        collected = time.perf_counter()
        # A step launched ahead starts on the device once the one before it is done.
        seconds = collected - max(launched.started, self._last_collected)
        self._last_collected = collected
        batch = launched.batch
        work = StepWork.of(batch)
        # Verification belongs to the decode side: a decode step with drafts is the normal
        # gap the pacer keeps prompt work beside.
        self.pacer.observe(work.num_decodes, work.prefill_tokens, seconds, work.staged)
        if self.speculator is not None and not work.prefill_tokens and not work.staged:
            # Drafting (in schedule) counts too: a draft model's passes cost per token.
            total = time.perf_counter() - scheduling
            self.speculator.observe_step(
                work.num_decodes + work.num_drafted, work.num_drafted, total
            )
        for item in batch:
            # Not one that ended (or was aborted) while in flight, has layers to go, or was
            # counted when the step after it was launched.
            if item.seq.status is not Status.FINISHED and item.completes and not item.counted:
                self._count_computed(item)
        deltas = [self._append(v) for v in verified if v.seq.status is not Status.FINISHED]
        if self._in_flight is not None and self.speculator is not None:
            for item in self._in_flight.batch:  # its decodes' input tokens are in now
                # A finished sequence is released with the next launch.
                if item.layers is None and item.seq.status is not Status.FINISHED:
                    self.speculator.propose_late(item.seq)
        num_generated = sum(len(d.new_token_ids) for d in deltas)
        self._update_stats(work, num_generated, seconds)
        self.stats.last_step_schedule_seconds = max(0.0, launched.started - scheduling)
        self.stats.last_step_finish_seconds = time.perf_counter() - collected
        return deltas

    def _launch_ahead(self, step: Launched) -> Launched | None:
        """Queue the step after `step` before reading `step`'s tokens, so the device runs
        it while the host reads them, appends them and comes back. Only where that step is
        known without them: greedy decodes sampled on the device, no drafts wanted (the
        speculator would plan none), no grammar to advance, and the scheduler would plan
        the same. Beside a long prompt going a few layers a step, its next layers go ahead
        too (see Scheduler.schedule_ahead): a step planned after the tokens were read leaves
        the device idle while the host plans and launches it (on the H200, decode-only
        steps beside a 110k-token prompt took 6.1 ms where the streams' gap alone is 4.8).
        A sequence that `step`'s token ends (EOS, a stop string) computes one token in vain;
        its output is never read."""
        if not step.plain_decode:
            return None
        decoding = [
            item.seq
            for item in step.batch
            if item.layers is None and item.seq.status is Status.RUNNING
        ]
        if any(seq.params.constraint is not None for seq in decoding):
            return None
        for item in step.batch:
            # A chunk's last layer is queued (it samples nothing: a plain decode step): its
            # tokens count now, so the next chunk can go in the step planned here. Whatever
            # reads them is queued after it.
            if item.layers is not None and item.completes and item.seq.status is Status.RUNNING:
                self._count_computed(item)
        batch = self.scheduler.schedule_ahead(decoding, [s for s in decoding if self._goes_on(s)])
        if not batch:
            return None
        decodes = [item.seq for item in batch if item.layers is None]
        if self.speculator is not None and not self.speculator.plan_none(decodes):
            return None
        if self.transfers is not None:
            self.transfers.save_evicted()
        self.stats.steps_launched_ahead += 1
        return self.runner.launch(batch, self.guides, feed=step)

    def _goes_on(self, seq: Sequence) -> bool:
        """The token in flight for `seq` cannot end it by length."""
        limit = seq.params.max_tokens
        return (limit is None or seq.num_output_tokens + 1 < limit) and (
            seq.num_tokens + 1 < self.max_model_len
        )

    def _append(self, verified: Verified) -> TokenDelta:
        """Append a step's tokens one at a time, stopping where a stop condition holds, so
        output with speculation is what decoding one token per step would give."""
        seq = verified.seq
        tokens: list[int] = []
        reason = None
        for token, logprob in zip(verified.token_ids, verified.logprobs, strict=True):
            seq.token_ids.append(token)
            if logprob is not None:
                seq.logprobs.append(logprob)
            tokens.append(token)
            grammar_done = self.guides.advance(seq, token)
            reason = "stop" if grammar_done else self._finish_reason(seq, token)
            if reason is not None:
                break
        if verified.num_drafted:
            self._settle_draft(verified, len(tokens))
        if self.speculator is not None:
            self.speculator.observe(seq, verified.token_ids, verified.num_drafted)
        if reason is not None:
            self.scheduler.finish(seq, reason)
            self._forget_if_done(seq.request_id)
        elif verified.num_drafted:
            self.scheduler.trim(seq)
        logprobs = [lp for lp in verified.logprobs[: len(tokens)] if lp is not None]
        return TokenDelta(
            request_id=seq.request_id,
            index=seq.index,
            new_token_ids=tokens,
            logprobs=logprobs or None,
            finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.num_cached_tokens or 0,
        )

    def _count_computed(self, item: ScheduledSeq) -> None:
        """The item's tokens have been through every layer: they count as computed, full
        blocks are cached, and siblings waiting for the prompt fork from it. Tokens split
        off a staged chunk that waited for them go on from where they stopped."""
        item.counted = True
        staged = item.seq.staged
        item.seq.staged = staged.rest if staged is not None else None
        forks_now = item.samples and item.seq.pending_forks
        before = item.seq.num_computed
        item.seq.num_computed += item.num_new - len(item.draft)
        if not item.draft:  # a verified sequence commits once its drafts are judged
            self.prefix.commit(item.seq, before)
        if forks_now:
            for child in item.seq.pending_forks:
                self._fork(item.seq, child)
            item.seq.pending_forks = []

    def _settle_draft(self, verified: Verified, num_appended: int) -> None:
        """The K/V of accepted draft tokens is valid: count it computed and commit full
        blocks; what rejected drafts wrote stays past num_computed, to be overwritten."""
        seq = verified.seq
        before = seq.num_computed - 1  # the step's own token was counted already
        seq.num_computed += min(num_appended, verified.num_accepted)
        self.prefix.commit(seq, before)

    def _fork(self, parent: Sequence, child: Sequence) -> None:
        """Start a sibling on the prompt KV its parent just computed: share full blocks,
        copy the partly filled last one (it is about to diverge)."""
        n_full = parent.num_prompt_tokens // self.config.block_size
        partial = parent.num_prompt_tokens % self.config.block_size
        child.status = Status.RUNNING
        child.num_cached_tokens = parent.num_cached_tokens
        self.scheduler.running.append(child)
        if partial and not self.scheduler.room_for(1):
            # No block to copy into: the sibling recomputes its prompt later instead.
            self.scheduler.preempt(child)
            return
        for block in parent.block_table[:n_full]:
            self.pool.share(block)
        child.block_table = parent.block_table[:n_full]
        child.block_keys = parent.block_keys[:n_full]
        if partial:
            copy = self.pool.allocate(after=child.block_table[-1] if n_full else None)
            if self.transfers is not None:
                self.transfers.save_evicted()  # the copy may land in a block just evicted
            self.runner.cache.copy_block(parent.block_table[n_full], copy)
            child.block_table.append(copy)
        child.num_computed = parent.num_prompt_tokens

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            return "stop"
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _update_stats(self, work: StepWork, num_generated: int, seconds: float) -> None:
        s = self.stats
        s.prompt_tokens_total += work.prefill_tokens + work.staged_tokens_done
        s.generation_tokens_total += num_generated
        s.steps += 1
        s.last_step_seconds = seconds
        s.last_step_decodes = work.num_decodes
        s.last_step_prefill_tokens = work.prefill_tokens + sum(t for t, _ in work.staged)
        s.last_step_prefill_layers = sum(layers for _, layers in work.staged)
        s.last_step_draft_tokens = work.num_drafted

    def snapshot(self) -> EngineStats:
        """Stats as of now (also between steps, e.g. after aborts)."""
        s = self.stats
        s.num_waiting = len(self.scheduler.waiting)
        s.num_running = len(self.scheduler.running)
        s.kv_blocks_used = self.pool.num_used
        s.num_preemptions = self.scheduler.num_preemptions
        s.staged_splits = self.runner.num_staged_splits
        p = self.prefix.stats
        s.prefix_queried_tokens = p.queried_tokens
        s.prefix_device_hit_tokens = p.device_hit_tokens
        s.prefix_partial_hit_tokens = p.partial_hit_tokens
        s.prefix_host_hit_tokens = p.host_hit_tokens
        s.prefix_disk_hit_tokens = p.disk_hit_tokens
        s.kv_blocks_cached = self.pool.num_cached
        s.kv_evictions = self.pool.num_evictions
        if self.transfers is not None:
            t = self.transfers.stats
            s.tier_bytes = {
                ("device", "host"): t.device_to_host,
                ("host", "device"): t.host_to_device,
                ("disk", "device"): t.disk_to_device,
            }
            if self.disk is not None:
                # Files are written from host RAM where there is a host tier.
                source = "host" if self.host is not None else "device"
                s.tier_bytes[(source, "disk")] = self.disk.bytes_written
        if self.host is not None:
            s.host_blocks = len(self.host)
            s.host_evictions = self.host.num_evictions
            s.host_bypassed = self.host.num_bypassed
        s.history_rewrites = p.history_rewrites
        s.history_rewritten_tokens = p.history_rewritten_tokens
        if self.disk is not None:
            s.disk_bytes = self.disk.num_bytes
            s.disk_files_corrupt = self.disk.num_corrupt
            s.disk_files_removed = self.disk.num_removed
        s.resident_memory_bytes = resident_memory_bytes()
        s.cpu_threads = self.threads.threads if self.threads is not None else 0
        if self.speculator is not None:
            spec = self.speculator.stats
            s.spec_drafted_tokens = dict(spec.drafted)
            s.spec_accepted_tokens = dict(spec.accepted)
            s.spec_verified_drafts = dict(spec.verified)
        return EngineStats(**vars(s))


def resident_memory_bytes() -> int:
    """This process's resident set size, from /proc (Linux); 0 elsewhere."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
