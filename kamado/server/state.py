"""What every request handler shares: the engine client, tokenizer, limits, admission, health."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kamado.server.chat_template import ChatTemplate
from kamado.server.errors import APIError, model_not_found, queue_full
from kamado.server.metrics import Metrics
from kamado.server.streaming import HEARTBEAT_SECONDS
from kamado.server.token_text import TokenText
from kamado.structured.tool_formats import ToolFormat


@dataclass
class ServerOptions:
    # The first name is the model id reported to clients; the others are accepted aliases.
    model_names: list[str]
    max_num_seqs: int = 64
    # Requests beyond max_num_seqs that may wait; one more is answered 503 + Retry-After.
    max_queued: int = 256
    bare_json_tool_calls: bool = True
    # /health fails when the engine has work but completed no step for this long.
    stall_timeout_s: float = 120.0
    # A streamed reply that has nothing to send for this long sends an SSE comment.
    heartbeat_s: float = HEARTBEAT_SECONDS
    chat_template_file: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_call_format: ToolFormat | None = None  # None: read from the chat template
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Health:
    ok: bool
    status: str
    detail: dict[str, Any]


class Lease:
    """One admitted request; release() is idempotent so every exit path may call it."""

    def __init__(self, state: ServerState) -> None:
        self._state: ServerState | None = state

    def release(self) -> None:
        if self._state is not None:
            self._state._release()
            self._state = None


class ServerState:
    def __init__(self, engine: Any, tokenizer: Any, options: ServerOptions) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.options = options
        self.template = ChatTemplate(
            tokenizer, options.chat_template_file, options.chat_template_kwargs
        )
        self.tool_format: ToolFormat = options.tool_call_format or self.template.tool_format
        self.token_text = TokenText(tokenizer)
        # End-of-turn token of the chat template; the engine also stops on the model's EOS ids.
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_token_ids: list[int] = [eos] if isinstance(eos, int) else []
        self.in_flight = 0
        self._busy_since: float | None = None
        # Why the supervisor is replacing the engine, while it is.
        self.recovering: str | None = None
        self.metrics = Metrics(lambda: self.engine.stats(), lambda: self.in_flight)
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        return self.options.model_names[0]

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def vocab_size(self) -> int | None:
        config = getattr(self.engine, "model_config", None)
        return getattr(config, "vocab_size", None)

    def check_model(self, requested: str | None) -> None:
        if not requested or requested in self.options.model_names:
            return
        raise model_not_found(requested, self.options.model_names[:1])

    # ---- admission: a bounded number of requests in flight ----------------------------

    def acquire(self) -> Lease:
        """Admit one request, or raise 503 + Retry-After; release the lease when it is done."""
        if self.in_flight >= self.options.max_num_seqs + self.options.max_queued:
            self.metrics.rejected.labels("queue_full").inc()
            raise queue_full(retry_after_s=self._retry_after())
        if self.in_flight == 0:
            self._busy_since = time.monotonic()
        self.in_flight += 1
        return Lease(self)

    def _release(self) -> None:
        self.in_flight -= 1

    def _retry_after(self) -> int:
        return 2 if self.options.max_queued == 0 else 5

    def check_alive(self) -> None:
        try:
            alive = self.engine.stats().alive
        except Exception:
            alive = False
        if not alive:
            raise APIError(
                "The inference engine is not running; the server cannot generate right now.",
                status=503,
                type="server_error",
                code="engine_unavailable",
                headers={"Retry-After": "10"},
            )

    # ---- health ------------------------------------------------------------------------

    def health(self) -> Health:
        try:
            s = self.engine.stats()
        except Exception as e:  # the client itself is broken: that is unhealthy too
            return Health(False, "engine_unreachable", {"error": str(e)})
        now = time.monotonic()
        # Progress is measured from the later of the last step and the moment work arrived,
        # so an engine that was idle for an hour is not "stalled" the instant a request lands.
        since = max(s.last_step_monotonic or 0.0, self._busy_since or 0.0)
        idle_for = now - since
        detail = {
            "model": self.model_name,
            "engine_alive": s.alive,
            "busy": s.busy,
            "seconds_since_progress": round(idle_for, 3) if s.busy else 0.0,
            "num_waiting": s.num_waiting,
            "num_running": s.num_running,
            "kv_blocks_used": s.kv_blocks_used,
            "kv_blocks_total": s.kv_blocks_total,
        }
        if self.recovering is not None:
            return Health(False, "recovering", {**detail, "reason": self.recovering})
        if not s.alive:
            return Health(False, "engine_dead", detail)
        # A step that took long (a big prefill chunk on a CPU) will again: allow a few of them.
        limit = max(self.options.stall_timeout_s, 3.0 * getattr(s, "last_step_seconds", 0.0))
        if s.busy and idle_for > limit:
            return Health(False, "engine_stalled", detail)
        return Health(True, "ok", detail)
