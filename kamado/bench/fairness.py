"""Do decoding streams keep their pace while a long prompt is prefilled beside them?

Three streams decode alone for a while, then a long prompt arrives; once it has its
first token the streams decode alone again. Every inter-token gap of the streams is
compared with their normal gap at the same context length: a stream's own steps slow
down as its context grows, and a paced prefill takes thousands of steps, so the median
gap alone before the prompt and the median gap alone after it are joined by a straight
line in the streams' context length. The same run is repeated without pacing (chunked
prefill at the full token budget, as general-purpose schedulers do).
"""

from __future__ import annotations

import bisect
import gc
import math
import resource
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch

from kamado.bench.lost_cpu import LostCpu
from kamado.bench.throughput import random_prompts
from kamado.config import EngineConfig
from kamado.engine.core import EngineCore
from kamado.engine.sampling_params import SamplingParams

STREAMS = 3
STREAM_PROMPT = 64
ALONE_STEPS = 100  # steps of the streams alone, before and after the long prompt
WORST_GAPS = 10  # the slowest steps beside the prompt kept in the results, a gap of each
TARGET_RATIO = 1.5  # the issues' target for the worst gap: every step past it is kept
PROGRESS_SECONDS = 30.0  # how often a prefill beside the streams reports its progress
# A gap is "quiet" where others took less CPU time in it (stolen plus waited) than this
# share of the normal gap: what is left past the target there is the engine's own doing.
QUIET_SHARE = 0.1
# A gap's local normal: the median gap of this many steps beside the prompt that carried no
# prompt work, the nearest to it (see Fairness.local).
LOCAL_NORMAL_STEPS = 9


class Gap(NamedTuple):
    seconds: float
    context: int  # the stream's length in tokens when its token arrived
    # The step that ended the gap: its forward pass, the host's work before and after it
    # (the rest of the gap is the step before's, the benchmark's loop and the OS), and the
    # prompt tokens it carried.
    step_seconds: float
    schedule_seconds: float
    finish_seconds: float
    prefill_tokens: int
    prefill_layers: int  # of a chunk going a few layers a step (0: none, or every layer)
    gc_seconds: float  # garbage collections during the step
    cpu_threads: int  # threads the step computed with (0 on an accelerator)
    step: int  # the engine's step count: the streams' gaps that one step ended share it
    ahead: int  # 1: launched before the step before it was read (its forward pass is the gap)
    device_mallocs: int  # segments the device's caching allocator asked the driver for
    # CPU time taken from the benchmark since the step before (see lost_cpu): CPU-seconds
    # the hypervisor gave other guests, over all cores, and seconds its threads waited for one.
    stolen_seconds: float
    waited_seconds: float


@dataclass
class Fairness:
    scheduler: str
    model: str
    prompt_len: int
    gap_before_ms: float  # median gap of the streams alone, before the prompt
    gap_after_ms: float  # ... and after it, at their longer context
    context_before: float
    context_after: float
    alone_worst_ratio: float  # the machine's own jitter: worst gap alone / normal gap
    worst_gap_ms: float
    worst_ratio: float  # worst gap beside the prompt / normal gap: the target figure
    p99_ratio: float
    median_ratio: float
    num_gaps: int
    prefill_seconds: float
    worst_gaps: list[dict]  # the slowest steps beside the prompt: a gap of each, its step
    alone_worst_gaps: list[dict]
    # The worst gap beside the prompt among quiet ones (QUIET_SHARE), and how many steps
    # past TARGET_RATIO were quiet: on a shared virtual machine, steal makes the worst gap.
    quiet_worst_ratio: float
    quiet_steps_past_target: int
    staged_splits: int  # staged chunks split where a layer overran, during the prompt
    # A check of the normal gap: the streams' gaps beside the prompt from steps that carried
    # no prompt work (the pacer's fresh measurements), per fifth of the prefill, as rows of
    # (median context, gaps, median ratio). Near 1.0 where the line through the gaps alone
    # is the streams' pace at that context; above it where the line runs low.
    decode_only_beside: list[list[float]]
    # Every step beside the prompt whose worst gap passed TARGET_RATIO, in step order, as
    # rows of the columns below (fewer keys: a run may have hundreds).
    over_target_columns: list[str]
    over_target: list[list[float]]
    # The same gaps, each against a local normal instead of the line: the median gap of the
    # LOCAL_NORMAL_STEPS steps nearest it that ran beside the prompt without prompt work.
    # A long CPU prefill takes an hour, over which this machine's pace drifts by a fifth
    # (decode_only_beside); the local normal follows the drift. Keys: worst, p99, median,
    # quiet_worst, quiet_steps_past_target. None where no step went without prompt work
    # (unpaced prefill) or too few did.
    local: dict[str, float] | None
    # Every engine step beside the prompt, as rows of STEP_COLUMNS: what each step carried
    # and took, and the pacer's slack then. A step past the target is machine noise where the
    # same chunk's layers in the steps around it took their usual time, and the pacer's
    # error where they took as long (the worst steps alone cannot tell the two apart).
    step_columns: list[str]
    steps: list[list[float]]


def _minor_faults() -> int:
    """Minor page faults this process has taken so far. On Linux each page of newly mapped
    memory (a large allocation's, say) faults when first touched, and a step that faults
    in megabytes pays for it in time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class CollectionTimer:
    """Seconds the garbage collector has run since this was made, until `close`."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0
        gc.callbacks.append(self._time)

    def _time(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._time)


class Streams:
    """Decoding streams in an engine, with every gap between their tokens recorded."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
        for i, prompt in enumerate(random_prompts(STREAMS, STREAM_PROMPT, vocab, seed=1)):
            engine.add_request(f"stream-{i}", prompt, params)
        self.last: dict[str, float] = {}
        self.length = {f"stream-{i}": STREAM_PROMPT for i in range(STREAMS)}
        # Kept as plain tuples of numbers, which the garbage collector stops tracking (a
        # Gap, a tuple subclass, stays tracked): a run keeps tens of thousands, and as
        # tracked objects they lengthened the collections whose pauses the gaps measure.
        self._rows: list[tuple] = []
        self._steps: list[tuple] = []  # one row per engine step (STEP_COLUMNS), likewise
        self.collections = CollectionTimer()
        self.lost = LostCpu()
        self._lost_at = self._lost_now()
        self._cuda = engine.runner.device if engine.runner.device.type == "cuda" else None
        self.worst = 0.0  # seconds, the longest gap since it was last set to 0
        while len(self.last) < STREAMS:  # prefill the streams
            self.step()

    def step(self) -> set[str]:
        """One engine step; returns the ids of the requests that got a token."""
        gc_before, segments = self.collections.seconds, self._device_segments()
        faults_before = _minor_faults()
        deltas = self.engine.step()
        faults = _minor_faults() - faults_before
        now = time.perf_counter()
        stats, gc_seconds = self.engine.stats, self.collections.seconds - gc_before
        mallocs = self._device_segments() - segments
        (stolen_before, waited_before), self._lost_at = self._lost_at, self._lost_now()
        stolen, waited = self._lost_at[0] - stolen_before, self._lost_at[1] - waited_before
        threads = self.engine.threads.threads if self.engine.threads is not None else 0
        worst = 0.0  # the longest gap this step ended
        for d in deltas:
            if d.request_id in self.length:
                self.length[d.request_id] += 1
                if d.request_id in self.last:
                    self._rows.append(
                        (now - self.last[d.request_id], self.length[d.request_id],
                         stats.last_step_seconds, stats.last_step_schedule_seconds,
                         stats.last_step_finish_seconds, stats.last_step_prefill_tokens,
                         stats.last_step_prefill_layers, gc_seconds, threads, stats.steps,
                         int(stats.last_step_launched_ahead), mallocs, stolen, waited)
                    )  # fmt: skip
                    worst = max(worst, now - self.last[d.request_id])
                self.last[d.request_id] = now
        self.worst = max(self.worst, worst)
        slack = self.engine.scheduler.pacer.staged_slack()
        self._steps.append(
            (stats.steps, stats.last_step_seconds, stats.last_step_prefill_tokens,
             stats.last_step_prefill_layers, stats.prompt_tokens_total, slack or 0.0, stolen,
             waited, worst, min(self.length.values()), faults)
        )  # fmt: skip
        return {d.request_id for d in deltas}

    def _lost_now(self) -> tuple[float, float]:
        return self.lost.stolen(), self.lost.waited()

    def _device_segments(self) -> int:
        """Segments the caching allocator has allocated so far (cudaMalloc takes
        milliseconds); 0 on a CPU."""
        if self._cuda is None:
            return 0
        return torch.cuda.memory_stats(self._cuda)["segment.all.allocated"]

    @property
    def count(self) -> int:
        """Gaps recorded so far."""
        return len(self._rows)

    @property
    def step_count(self) -> int:
        """Engine steps recorded so far."""
        return len(self._steps)

    def step_rows(self, start: int, end: int) -> list[tuple]:
        """The engine steps recorded from the `start`-th up to the `end`-th, as tuples of
        (step, seconds, prefill tokens, prefill layers, prompt tokens done in all, pacer's
        slack s, stolen s, waited s, the longest gap it ended s, the streams' context, minor
        page faults during the step)."""
        return self._steps[start:end]

    def gaps(self, start: int = 0, end: int | None = None) -> list[Gap]:
        """The gaps recorded from the `start`-th on (up to the `end`-th)."""
        return [Gap._make(row) for row in self._rows[start:end]]

    def alone(self, steps: int) -> list[Gap]:
        start = self.count
        for _ in range(steps):
            self.step()
        return self.gaps(start)

    def close(self) -> None:
        for request_id in self.length:
            self.engine.abort(request_id)
        self.collections.close()


def measure(engine: EngineCore, model: str, label: str, prompt_len: int) -> Fairness:
    # Made first: 131k random ids take tens of ms, which would land inside a gap.
    long_prompt = random_prompts(1, prompt_len, engine.model_config.vocab_size, seed=2)[0]
    streams = Streams(engine)
    before = streams.alone(ALONE_STEPS)
    streams.worst = 0.0
    engine.add_request("long", long_prompt, SamplingParams(temperature=0.0, max_tokens=1))
    start, first_step, started = streams.count, streams.step_count, time.perf_counter()
    computed_before, reported = engine.stats.prompt_tokens_total, started
    splits_before = engine.snapshot().staged_splits
    while "long" not in streams.step():
        if (now := time.perf_counter()) - reported >= PROGRESS_SECONDS:
            # A long paced prefill runs for many minutes: show where it is.
            reported = now
            done = engine.stats.prompt_tokens_total - computed_before
            print(
                f"  {label}: {done} of {prompt_len} prompt tokens after {now - started:.0f} s, "
                f"worst gap so far {streams.worst * 1e3:.1f} ms",
                flush=True,
            )
    prefill_seconds = time.perf_counter() - started
    staged_splits = engine.snapshot().staged_splits - splits_before
    # The gaps beside the prompt are made after the streams' last steps alone: tens of
    # thousands of them took 60 ms, which lay in the first gap after the prompt.
    end, last_step = streams.count, streams.step_count
    after = streams.alone(ALONE_STEPS)
    if not after:  # the streams stopped at max_model_len: gaps beside the prompt are missing
        raise RuntimeError(
            f"the streams reached {engine.max_model_len} tokens before the prompt was done"
        )
    beside = streams.gaps(start, end)
    streams.close()

    def median(gaps: list[Gap]) -> tuple[float, float]:
        return (
            statistics.median(g.context for g in gaps),
            statistics.median(g.seconds for g in gaps),
        )

    (x0, y0), (x1, y1) = median(before), median(after)

    def normal(context: float) -> float:
        return y0 + (y1 - y0) * (context - x0) / (x1 - x0)

    def ratio(gap: Gap) -> float:
        return gap.seconds / normal(gap.context)

    def rank(gaps: list[Gap]) -> list[tuple[float, Gap]]:
        return _ranked((ratio(g), g) for g in gaps)

    ranked = rank(beside)
    line = _summary(ranked)
    normals = _local_normals(beside)
    local = None
    if normals is not None:
        local = _summary(_ranked((g.seconds / n, g) for g, n in zip(beside, normals, strict=True)))
    return Fairness(
        scheduler=label,
        model=model,
        prompt_len=prompt_len,
        gap_before_ms=y0 * 1e3,
        gap_after_ms=y1 * 1e3,
        context_before=x0,
        context_after=x1,
        alone_worst_ratio=max(ratio(g) for g in before + after),
        worst_gap_ms=max(g.seconds for g in beside) * 1e3,
        worst_ratio=line["worst"],
        p99_ratio=line["p99"],
        median_ratio=line["median"],
        num_gaps=len(ranked),
        prefill_seconds=prefill_seconds,
        worst_gaps=[_record(r, g) for r, g in _worst_steps(ranked)],
        # The streams' own worst steps alone: the machine's jitter, and where it falls (the
        # steps right after the prompt, say). Context tells before from after.
        alone_worst_gaps=[_record(r, g) for r, g in _worst_steps(rank(before + after))[:3]],
        quiet_worst_ratio=line["quiet_worst"],
        quiet_steps_past_target=line["quiet_steps_past_target"],
        staged_splits=staged_splits,
        decode_only_beside=_decode_only_by_fifth([(ratio(g), g) for g in beside]),
        over_target_columns=list(OVER_TARGET_COLUMNS),
        over_target=_over_target(ranked),
        local=local,
        step_columns=list(STEP_COLUMNS),
        steps=[
            _step_row(row, computed_before, normal)
            for row in streams.step_rows(first_step, last_step)
        ],
    )


def _ranked(pairs: Iterable[tuple[float, Gap]]) -> list[tuple[float, Gap]]:
    """(ratio, gap) pairs from the lowest ratio up; ties (a step's streams) keep their order."""
    return sorted(pairs, key=lambda pair: pair[0])


def _summary(ranked: list[tuple[float, Gap]]) -> dict[str, float]:
    """The figures of ranked gaps against one normal: worst, p99 and median ratio, and the
    worst among quiet gaps with the number of quiet steps past TARGET_RATIO."""
    ratios = [r for r, _ in ranked]
    quiet = _quiet(ranked)
    return dict(
        worst=ratios[-1],
        p99=ratios[int(0.99 * (len(ratios) - 1))],
        median=statistics.median(ratios),
        quiet_worst=max((r for r, _ in quiet), default=0.0),
        quiet_steps_past_target=len(_past_target(quiet)),
    )


def _quiet(ranked: list[tuple[float, Gap]]) -> list[tuple[float, Gap]]:
    """The gaps in which others took less CPU time than QUIET_SHARE of their normal gap."""
    return [
        (r, g)
        for r, g in ranked
        if g.stolen_seconds + g.waited_seconds < QUIET_SHARE * g.seconds / r
    ]


def _past_target(ranked: list[tuple[float, Gap]]) -> list[tuple[float, Gap]]:
    """The steps (each by its worst gap) whose gap passed TARGET_RATIO."""
    return _worst_steps([(r, g) for r, g in ranked if r > TARGET_RATIO], limit=None)


def _local_normals(gaps: list[Gap]) -> list[float] | None:
    """Each gap's local normal: the median of the median gaps of the LOCAL_NORMAL_STEPS
    steps without prompt work nearest it in step order; None with fewer such steps."""
    by_step: dict[int, list[float]] = {}
    for g in gaps:
        if g.prefill_tokens == 0:
            by_step.setdefault(g.step, []).append(g.seconds)
    steps = sorted(by_step)
    if len(steps) < LOCAL_NORMAL_STEPS:
        return None
    step_gaps = [statistics.median(by_step[s]) for s in steps]
    normals = []
    for g in gaps:
        # The window of LOCAL_NORMAL_STEPS centred on the gap's step, kept inside the list.
        at = bisect.bisect_left(steps, g.step) - LOCAL_NORMAL_STEPS // 2
        first = min(max(at, 0), len(steps) - LOCAL_NORMAL_STEPS)
        normals.append(statistics.median(step_gaps[first : first + LOCAL_NORMAL_STEPS]))
    return normals


OVER_TARGET_COLUMNS = ("step", "ratio", "gap_ms", "step_ms", "schedule_ms", "finish_ms",
                       "prefill_tokens", "prefill_layers", "gc_ms", "context",
                       "ahead", "device_mallocs", "stolen_ms", "waited_ms")  # fmt: skip


STEP_COLUMNS = ("step", "step_ms", "prefill_tokens", "prefill_layers", "prompt_done",
                "slack_ms", "stolen_ms", "waited_ms", "gap_ms", "ratio", "context",
                "minor_faults")  # fmt: skip


def _step_row(row: tuple, computed_before: int, normal: Callable[[float], float]) -> list[float]:
    """One engine step as STEP_COLUMNS: times in ms to 0.1, `prompt_done` counted from
    `computed_before`, and its longest gap's ratio to the normal gap at the streams' context
    (0 where it ended none)."""
    step, seconds, tokens, layers, done, slack, stolen, waited, gap, context, faults = row
    gap_ratio = gap / normal(context) if gap else 0.0
    ms = [round(x * 1e3, 1) for x in (seconds, slack, stolen, waited, gap)]
    return [step, ms[0], tokens, layers, done - computed_before, *ms[1:], round(gap_ratio, 3),
            context, faults]  # fmt: skip


def _over_target(ranked: list[tuple[float, Gap]]) -> list[list[float]]:
    rows = []
    for r, g in sorted(_past_target(ranked), key=lambda pair: pair[1].step):
        record = _record(r, g)
        rows.append([round(record[c], 3) for c in OVER_TARGET_COLUMNS])
    return rows


def _decode_only_by_fifth(gaps: list[tuple[float, Gap]]) -> list[list[float]]:
    """(median context, count, median ratio) of the gaps from steps without prompt work,
    in each fifth of `gaps` (in step order) that has any."""
    rows = []
    for fifth in range(5):
        part = gaps[fifth * len(gaps) // 5 : (fifth + 1) * len(gaps) // 5]
        decode_only = [(r, g) for r, g in part if g.prefill_tokens == 0]
        if decode_only:
            context = statistics.median(g.context for _, g in decode_only)
            ratio = statistics.median(r for r, _ in decode_only)
            rows.append([context, len(decode_only), round(ratio, 3)])
    return rows


def _record(ratio: float, g: Gap) -> dict:
    return dict(
        ratio=ratio,
        gap_ms=g.seconds * 1e3,
        step_ms=g.step_seconds * 1e3,
        schedule_ms=g.schedule_seconds * 1e3,
        finish_ms=g.finish_seconds * 1e3,
        prefill_tokens=g.prefill_tokens,
        prefill_layers=g.prefill_layers,
        gc_ms=g.gc_seconds * 1e3,
        cpu_threads=g.cpu_threads,
        context=g.context,
        step=g.step,
        ahead=g.ahead,
        device_mallocs=g.device_mallocs,
        stolen_ms=g.stolen_seconds * 1e3,
        waited_ms=g.waited_seconds * 1e3,
    )


def _worst_steps(
    ranked: list[tuple[float, Gap]], limit: int | None = WORST_GAPS
) -> list[tuple[float, Gap]]:
    """The `limit` slowest steps (all), each by its worst gap: every stream waits on the
    same step, so listing gaps would repeat each step once per stream."""
    seen: set[int] = set()
    worst = []
    for r, g in reversed(ranked):
        if g.step not in seen:
            seen.add(g.step)
            worst.append((r, g))
            if len(worst) == limit:
                break
    return worst


def _stream_room(prompt_len: int, factor: float) -> int:
    """Tokens a stream may reach: it grows a token a step while the prompt is prefilled.
    Paced chunks go a few layers a step but grow to tens of tokens, so at the default bound
    (1.25) a prompt takes fewer steps than it has tokens, and twice its length is room
    enough. A tighter bound leaves less slack a step, so more steps: at 1.1 a 4k prompt
    took over 9,000 (on a slow machine, 2026-12-06)."""
    slack = max(factor - 1.0, 0.05)  # a bound of 1.0 still moves MIN_CHUNK tokens a step
    return int(max(2.0, 0.5 / slack) * prompt_len) + 1024


def run_fairness(
    model: str,
    device: str,
    dtype: str,
    prompt_len: int,
    compare: bool = True,
    decode_stall_factor: float = EngineConfig.decode_stall_factor,
) -> list[dict]:
    results = []
    paced = EngineConfig(
        model=model, device=device, dtype=dtype, decode_stall_factor=decode_stall_factor
    )
    configs = [("kamado (paced)", paced)]
    if compare:
        unpaced = EngineConfig(
            model=model, device=device, dtype=dtype, decode_stall_factor=float("inf")
        )
        configs.append(("unpaced chunked prefill", unpaced))
    for label, config in configs:
        config.max_model_len = _stream_room(prompt_len, config.decode_stall_factor)
        # Gaps are per token: speculation's several tokens a step would blur what pacing does.
        config.speculation = "off"
        engine = EngineCore(config)
        bound = config.decode_stall_factor if math.isfinite(config.decode_stall_factor) else None
        if bound is not None:
            print(f"{label}: a step with prompt work may take up to {bound:g}x a decode-only "
                  "step", flush=True)  # fmt: skip
        r = measure(engine, model, label, prompt_len)
        print(
            f"{label:24s} {model}: {prompt_len}-token prompt beside {STREAMS} streams "
            f"(normal gap {r.gap_before_ms:.1f} ms at {r.context_before:.0f} tokens, "
            f"{r.gap_after_ms:.1f} ms at {r.context_after:.0f}; alone, the worst gap is "
            f"{r.alone_worst_ratio:.2f}x normal): worst gap beside the prompt "
            f"{r.worst_gap_ms:.1f} ms = {r.worst_ratio:.2f}x normal, p99 {r.p99_ratio:.2f}x, "
            f"median {r.median_ratio:.2f}x, {len(r.over_target)} steps past "
            f"{TARGET_RATIO}x; prefill took {r.prefill_seconds:.1f} s; in gaps where others "
            f"took under {QUIET_SHARE:.0%} of a normal gap's CPU time, worst "
            f"{r.quiet_worst_ratio:.2f}x, {r.quiet_steps_past_target} steps past {TARGET_RATIO}x; "
            f"{r.staged_splits} staged chunks split",
            flush=True,
        )
        checks = ", ".join(f"{ratio:.2f}x at {context:.0f} ({count})"
                           for context, count, ratio in r.decode_only_beside)  # fmt: skip
        print(f"  gaps of steps without prompt work beside it, per fifth: {checks}", flush=True)
        if (local := r.local) is not None:
            print(
                f"  against the median gap of the {LOCAL_NORMAL_STEPS} nearest steps without "
                f"prompt work: worst {local['worst']:.2f}x, p99 {local['p99']:.2f}x, median "
                f"{local['median']:.2f}x; in quiet gaps worst {local['quiet_worst']:.2f}x, "
                f"{local['quiet_steps_past_target']} steps past {TARGET_RATIO}x",
                flush=True,
            )
        for g in r.worst_gaps[:3]:
            print(
                f"  a {g['ratio']:.2f}x gap: {g['gap_ms']:.1f} ms, of which scheduling "
                f"{g['schedule_ms']:.1f} ms, the forward pass {g['step_ms']:.1f} ms and after "
                f"it {g['finish_ms']:.1f} ms, with {g['prefill_tokens']} prompt tokens"
                + (f" through {g['prefill_layers']} layers" if g["prefill_layers"] else "")
                + f" on {g['cpu_threads']} threads"
                + (", launched ahead" if g["ahead"] else "")
                + (f", {g['device_mallocs']} device mallocs" if g["device_mallocs"] else "")
                + f"; garbage collection {g['gc_ms']:.1f} ms"
                + f"; CPU lost to others: {g['stolen_ms']:.0f} ms stolen, "
                f"{g['waited_ms']:.1f} ms waited",
                flush=True,
            )
        results.append({**asdict(r), "decode_stall_factor": bound})
        del engine
    return results
