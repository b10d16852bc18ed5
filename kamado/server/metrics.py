"""Prometheus metrics: engine state read at scrape time, latencies measured in the server."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1, 2.5)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self._stats = stats
        self._in_flight = in_flight

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "kamado_requests_in_flight",
            "Requests admitted by the server and not yet finished",
            value=self._in_flight(),
        )
        try:
            s = self._stats()
        except Exception:
            return
        gauges = {
            "kamado_num_requests_waiting": ("Sequences queued in the engine", s.num_waiting),
            "kamado_num_requests_running": ("Sequences being decoded", s.num_running),
            "kamado_kv_blocks_used": ("KV cache blocks in use", s.kv_blocks_used),
            "kamado_kv_blocks_total": ("KV cache blocks in the pool", s.kv_blocks_total),
            "kamado_kv_cache_usage_ratio": (
                "Fraction of KV cache blocks in use",
                s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0,
            ),
            "kamado_engine_alive": ("1 if the engine core process is alive", float(s.alive)),
            "kamado_engine_resident_memory_bytes": (
                "Resident memory of the engine core process",
                s.resident_memory_bytes,
            ),
            "kamado_engine_cpu_threads": (
                "CPU threads the model computes with (they follow the idle cores)",
                s.cpu_threads,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(name, doc, value=value)
        yield CounterMetricFamily(
            "kamado_prompt_tokens", "Prompt tokens processed", value=s.prompt_tokens_total
        )
        yield CounterMetricFamily(
            "kamado_generation_tokens", "Tokens generated", value=s.generation_tokens_total
        )
        yield CounterMetricFamily(
            "kamado_decode_steps_launched_ahead",
            "Decode steps queued before the previous step's tokens were read (overlap_decode)",
            value=s.steps_launched_ahead,
        )
        yield from _prefix_cache_metrics(s)
        yield from _speculation_metrics(s)


def _prefix_cache_metrics(s: Any) -> Iterator[Any]:
    yield CounterMetricFamily(
        "kamado_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache",
        value=s.prefix_queried_tokens,
    )
    hits = CounterMetricFamily(
        "kamado_prefix_cache_hit_tokens", "Prompt tokens found in the prefix cache", labels=["tier"]
    )
    rate = GaugeMetricFamily(
        "kamado_prefix_cache_hit_rate", "Hit tokens / queried tokens, by tier", labels=["tier"]
    )
    for tier, value in (
        ("device", s.prefix_device_hit_tokens),
        ("host", s.prefix_host_hit_tokens),
        ("disk", s.prefix_disk_hit_tokens),
    ):
        hits.add_metric([tier], value)
        rate.add_metric([tier], value / s.prefix_queried_tokens if s.prefix_queried_tokens else 0.0)
    yield hits
    yield rate
    yield CounterMetricFamily(
        "kamado_prefix_cache_partial_hit_tokens",
        "Device hit tokens copied from inside a cached block (a partly matched block)",
        value=s.prefix_partial_hit_tokens,
    )
    yield CounterMetricFamily(
        "kamado_prefix_history_rewrites",
        "Turns whose prompt changed the session's previous prompt (chat template or client "
        "rewrote history)",
        value=s.history_rewrites,
    )
    yield CounterMetricFamily(
        "kamado_prefix_history_rewritten_tokens",
        "Tokens of earlier turns recomputed because the history was rewritten",
        value=s.history_rewritten_tokens,
    )
    yield GaugeMetricFamily(
        "kamado_kv_blocks_cached",
        "Unreferenced KV blocks kept for prefix reuse",
        value=s.kv_blocks_cached,
    )
    evictions = CounterMetricFamily(
        "kamado_kv_evictions",
        "Cached blocks evicted from a tier: device blocks reused, host-RAM blocks pushed "
        "out (kept on disk), disk files removed for the size cap",
        labels=["tier"],
    )
    evictions.add_metric(["device"], s.kv_evictions)
    evictions.add_metric(["host"], s.host_evictions)
    evictions.add_metric(["disk"], s.disk_files_removed)
    yield evictions
    yield CounterMetricFamily(
        "kamado_kv_host_bypassed_blocks",
        "Evicted device blocks lost because no host-RAM slot was free of pending copies",
        value=s.host_bypassed,
    )
    yield GaugeMetricFamily(
        "kamado_kv_host_blocks", "Blocks held in the host-RAM tier", value=s.host_blocks
    )
    moved = CounterMetricFamily(
        "kamado_kv_tier_bytes", "KV bytes moved between tiers", labels=["source", "destination"]
    )
    for (source, destination), value in sorted(s.tier_bytes.items()):
        moved.add_metric([source, destination], value)
    yield moved
    yield GaugeMetricFamily(
        "kamado_kv_disk_bytes", "Size of the disk tier's directory", value=s.disk_bytes
    )
    yield CounterMetricFamily(
        "kamado_kv_disk_files_corrupt",
        "Disk tier files that failed their checks and were removed",
        value=s.disk_files_corrupt,
    )


def _speculation_metrics(s: Any) -> Iterator[Any]:
    drafted = CounterMetricFamily(
        "kamado_spec_draft_tokens", "Draft tokens verified, by proposer", labels=["proposer"]
    )
    accepted = CounterMetricFamily(
        "kamado_spec_accepted_tokens", "Draft tokens accepted, by proposer", labels=["proposer"]
    )
    verified = CounterMetricFamily(
        "kamado_spec_verified_drafts", "Drafts verified, by proposer", labels=["proposer"]
    )
    rate = GaugeMetricFamily(
        "kamado_spec_acceptance_rate",
        "Accepted / drafted tokens, by proposer",
        labels=["proposer"],
    )
    length = GaugeMetricFamily(
        "kamado_spec_mean_accepted_length",
        "Draft tokens accepted per verified draft, by proposer",
        labels=["proposer"],
    )
    for proposer, num_drafted in s.spec_drafted_tokens.items():
        num_accepted = s.spec_accepted_tokens.get(proposer, 0)
        num_verified = s.spec_verified_drafts.get(proposer, 0)
        drafted.add_metric([proposer], num_drafted)
        accepted.add_metric([proposer], num_accepted)
        verified.add_metric([proposer], num_verified)
        rate.add_metric([proposer], num_accepted / num_drafted if num_drafted else 0.0)
        length.add_metric([proposer], num_accepted / num_verified if num_verified else 0.0)
    yield from (drafted, accepted, verified, rate, length)


class Metrics:
    def __init__(self, stats: Callable[[], Any], in_flight: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats, in_flight))
        ProcessCollector(registry=self.registry)  # the server's own process_* (memory, fds)
        self.ttft = Histogram(
            "kamado_time_to_first_token_seconds",
            "Time from request arrival to its first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.itl = Histogram(
            "kamado_inter_token_latency_seconds",
            "Time between successive tokens of a sequence",
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "kamado_request_duration_seconds",
            "Time from request arrival to its last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.requests = Counter(
            "kamado_requests",
            "Finished requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=self.registry,
        )
        self.bare_json_tool_calls = Counter(
            "kamado_bare_json_tool_calls",
            "Replies that were only a JSON tool call (bare or fenced) returned as tool_calls",
            registry=self.registry,
        )
        self.engine_restarts = Counter(
            "kamado_engine_restarts",
            "Times the engine core was restarted after dying or hanging",
            registry=self.registry,
        )
        self.recovery = Histogram(
            "kamado_engine_recovery_seconds",
            "From an engine's death or last progress before a hang to its replacement serving",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.resumed_requests = Counter(
            "kamado_requests_resumed",
            "Requests that continued on a restarted engine from the tokens they had",
            registry=self.registry,
        )
        self.rejected = Counter(
            "kamado_requests_rejected",
            "Requests refused before generation, by reason",
            ["reason"],
            registry=self.registry,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
