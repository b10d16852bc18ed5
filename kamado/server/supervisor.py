"""Brings the engine core back when it dies or hangs, so an unattended server heals itself.

The HTTP side keeps its socket; requests in flight on the old core continue on the new one
(see generation.py), /health answers "recovering" meanwhile, and new requests get 503 +
Retry-After until the new core has loaded. The time from the death (or from the last
progress before a hang) to serving again is logged and exported.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kamado.server.state import ServerState

log = logging.getLogger("kamado.server")


class Supervisor:
    def __init__(
        self,
        state: ServerState,
        start_engine: Callable[[], Awaitable[Any]],
        restart_after_stall_s: float,
        check_every_s: float = 1.0,
    ) -> None:
        self.state = state
        self.start_engine = start_engine
        # A hung core is restarted after this long without progress (0: never, only if dead).
        self.restart_after_stall_s = restart_after_stall_s
        self.check_every_s = check_every_s
        self.restarts = 0

    def _needs_restart(self) -> tuple[str, float] | None:
        """Why the engine must be replaced, and since when (monotonic) it has not served."""
        h = self.state.health()
        if h.status in ("engine_dead", "engine_unreachable"):
            return "the engine process died", time.monotonic()
        stalled_for = h.detail.get("seconds_since_progress", 0.0)
        if (
            h.status == "engine_stalled"
            and self.restart_after_stall_s > 0
            and stalled_for > self.restart_after_stall_s
        ):
            reason = f"the engine made no progress for {stalled_for:.0f} s"
            return reason, time.monotonic() - stalled_for
        return None

    async def restart(self, reason: str, down_since: float) -> None:
        log.warning("%s; restarting it", reason)
        self.state.recovering = reason
        old = self.state.engine
        try:
            await old.shutdown()  # kills it if it does not exit on its own
        except Exception as e:  # it is being replaced either way
            log.warning("engine shutdown failed: %s", e)
        while True:
            try:
                self.state.engine = await self.start_engine()
                break
            except Exception as e:
                log.error("engine restart failed (%s); retrying in 10 s", e)
                await asyncio.sleep(10)
        self.state.recovering = None
        self.restarts += 1
        recovery_s = time.monotonic() - down_since
        self.state.metrics.engine_restarts.inc()
        self.state.metrics.recovery.observe(recovery_s)
        log.warning(
            "engine restarted, serving again %.1f s after it went down (%d restart(s) so far)",
            recovery_s,
            self.restarts,
        )

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.check_every_s)
            if trouble := self._needs_restart():
                await self.restart(*trouble)

    async def close(self) -> None:
        await self.state.engine.shutdown()
